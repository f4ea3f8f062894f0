"""``compare``'s variant specs: ``name[key=value,...]+modifier...`` parsed into :class:`VariantSpec`, comma lists
split and ``all`` / ``all+baselines`` expanded (the grammar is in :mod:`gpattn.experiments.compare`). Split from
:mod:`gpattn.experiments.compare`, which re-exports every name."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import re

from gpattn.attention.registry import attention_class, attention_options, list_attention

__all__ = ["BASELINES", "VariantSpec", "expand_variants", "parse_variant", "split_variants"]

BASELINES = ("softmax+ts", "softmax+mcdropout", "softmax+laplace", "softmax+sngp", "softmax+ens5")


@dataclasses.dataclass(frozen=True)
class VariantSpec:
    spec: str
    attention: str
    ts: bool = False
    mcdropout: bool = False
    laplace: bool = False
    ensemble: int = 1
    options: tuple = ()  # ((key, value), ...) from ``name[key=value,...]``
    sngp: bool = False
    gpreadout: bool = False  # post hoc: gpattn.experiments.readout on the run's head

    @property
    def run_name(self) -> str:
        """The trained model this spec evaluates (post-hoc modifiers need no run of their own)."""
        opts = "[" + ",".join(f"{k}={v}" for k, v in self.options) + "]" if self.options else ""
        return self.attention + opts + ("+mcdropout" if self.mcdropout else "") + ("+sngp" if self.sngp else "")

    @property
    def folder_name(self) -> str:
        """:attr:`run_name` as a folder name no shell needs quoted (``sgpa-rff[gp_input=sequence]`` is a glob in bash
        and an error in zsh): ``sgpa-rff_gp_input=sequence``; a name that lost more than its brackets keeps a short
        hash of the run name, so that two runs never share a folder."""
        name = self.run_name
        safe = _UNSAFE.sub("_", name).strip("_")
        if _UNSAFE.sub("", name.replace("[", "").replace("]", "")) != name.replace("[", "").replace("]", ""):
            safe += "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
        return safe


#: characters a folder name keeps (others need quoting in some shell)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.,=+-]+")
_SPEC = re.compile(r"\s*([A-Za-z0-9_-]+)\s*(?:\[([^\]]*)\])?\s*((?:\+[^+]*)*)\s*")


def _option_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_variant(spec: str) -> VariantSpec:
    """One variant spec of ``compare`` (``name[key=value,...]+modifier...``, e.g. ``sto[tau=2.0]+ts``) as a
    :class:`VariantSpec`; a ``ValueError`` naming the spec when it does not parse."""
    match = _SPEC.fullmatch(spec)
    if match is None:
        raise ValueError(
            f"cannot parse variant {spec!r}: expected name[key=value,...]+modifier, e.g. sto[tau=2]+ts"
        )
    name, opts, mod_text = match.group(1), match.group(2), match.group(3)
    attention_class(name)  # ValueError listing the valid names
    options = []
    if opts is not None:
        valid = attention_options(name)
        for item in (t.strip() for t in opts.split(",") if t.strip()):
            if "=" not in item:
                raise ValueError(f"variant {spec!r}: expected key=value inside [...], got {item!r}")
            key, value = (t.strip() for t in item.split("=", 1))
            if key not in valid:
                known = ", ".join(sorted(valid))
                raise ValueError(f"variant {spec!r}: unknown option {key!r} for attention {name!r}; valid: {known}")
            options.append((key, _option_value(value)))
    ts = mc = la = sn = ro = False
    ens = 1
    for mod in (m.strip() for m in mod_text.split("+")[1:]):
        if mod == "ts":
            ts = True
        elif mod == "laplace":
            la = True
        elif mod == "mcdropout":
            mc = True
        elif mod == "sngp":
            sn = True
        elif mod == "gpreadout":
            ro = True
        elif re.fullmatch(r"ens\d+", mod) and int(mod[3:]) >= 2:
            ens = int(mod[3:])
        else:
            raise ValueError(
                f"unknown modifier {mod!r} in variant {spec!r}; valid: +ts, +laplace, +mcdropout, +sngp, +gpreadout, "
                "+ensN (N >= 2)"
            )
    if sn and la:
        raise ValueError(f"variant {spec!r}: +sngp and +laplace are two Laplace heads; choose one")
    if ro and (sn or la):
        raise ValueError(f"variant {spec!r}: +gpreadout reads the run's linear head, which +sngp replaces and +laplace "
                         "samples; choose one")
    return VariantSpec(spec.strip(), name, ts, mc, la, ens, tuple(options), sn, ro)


def split_variants(text: str) -> list[str]:
    """A comma list of specs, commas inside ``[...]`` kept: ``"sto[tau=2,hard=True],softmax+ts"``."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in [*parts, cur] if p.strip()]


def expand_variants(variants, variant_options: dict | None = None) -> list[VariantSpec]:
    """A comma list or list of specs; ``all`` = every registered variant; ``all+baselines`` adds
    :data:`BASELINES` (softmax+ts, softmax+mcdropout, softmax+laplace, softmax+sngp and a deep ensemble softmax+ens5).
    ``variant_options`` (a preset's ``{name: {option: value}}``) fills in options a spec does not set."""
    if isinstance(variants, str):
        variants = split_variants(variants)
    out: list[str] = []
    for v in variants:
        if v == "all":
            out += list_attention()
        elif v == "all+baselines":
            out += list_attention() + list(BASELINES)
        else:
            out.append(v)
    if not out:
        raise ValueError("no variants to compare")
    specs = [parse_variant(v) for v in dict.fromkeys(out)]
    if variant_options:
        specs = [
            dataclasses.replace(s, options=tuple({**variant_options[s.attention], **dict(s.options)}.items()))
            if s.attention in variant_options else s
            for s in specs
        ]
    return specs

"""Fingerprint every attention variant × form, to prove a refactor changes no number.

For each variant of ``gpattn.list_attention()`` and each of its forms (the option values that select a model:
``prior_mean``, ``qk``, ``covariance``, ``gp_input``, ``merge``, kep-svgp's and the correlated GPs' flags, ``amortize``,
and the recipes' settings), in float32 and float64, under fixed
seeds, it records: the train-mode output (a seeded sample) and the ``deterministic()`` output under no mask,
key padding, a causal mask, a general per-query mask and cross-attention (an error's type and message where a
form refuses a mask); ``loss_terms()``; the gradient of a scalar of both w.r.t. every parameter; and the state
dict (keys, shapes, values); a GP variant's ``posterior(x)`` mean and variance.

    python tools/fingerprint.py /tmp/fp_before.pt          # record (gpattn imported from this checkout)
    python tools/fingerprint.py /tmp/fp_after.pt --compare /tmp/fp_before.pt

A case is named by its form's options as 6d6cabf spelled them; in a checkout where an option left
the layers (``gpattn.attention.registry.RECIPES`` has ``"out-of-scope"``), :func:`layer_options` builds the same model
through the recipe, object or research probe (research/knobs.py) that owns the form now.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout this script lives in
import torch  # noqa: E402

import gpattn  # noqa: E402

#: the options that select a model, per variant (small sizes for speed)
FORMS = {
    "sgpa": {
        "prior_mean": ["attention", "softmax", "zero"], "qk": ["shared", "separate"], "covariance": ["full", "diag"],
    },
    "sgpa-decoupled": {
        "prior_mean": ["attention", "softmax", "zero"], "qk": ["shared", "separate"], "covariance": ["full", "diag"],
    },
    "sgpa-rff": {
        "prior_mean": ["attention", "softmax"], "qk": ["shared", "separate"], "gp_input": ["query", "sequence"],
    },
    "kep-svgp": {
        "prior_mean": ["softmax", "softmax-separate", "zero"], "merge": ["add", "concat"],
        "token_independent": [False, True], "include_residual": [False, True], "feature_gradient": [True, False],
    },
    "cgp": {
        "prior_mean": ["softmax", "softmax-separate", "zero"], "learn_sigma": [False, True],
        "prior_samples": [10, None],
    },
    "scgp": {
        "prior_mean": ["softmax", "softmax-separate", "zero"], "amortize": [False, True], "learn_sigma": [False, True],
    },
}
#: forms outside the grids: the recipes' settings as the options that spelled them (sgpa-rff's encoder swap; the
#: sequence form with the CLINC150 setting), per variant
EXTRA = {
    "sgpa-rff": [
        {"prior_mean": "softmax", "qk": "separate", "gp_input": "query", "lengthscale": 1.0},
        {"prior_mean": "softmax", "qk": "separate", "gp_input": "sequence", "num_features": 1024, "lengthscale": 0.2,
         "data_weight": 10000.0},
    ],
}
#: fixed options per variant (sizes)
FIXED = {
    "sgpa-decoupled": {"num_global": 3}, "sgpa-rff": {"num_features": 6},
    "scgp": {"num_inducing": 3, "num_inducing_keys": 4},
}
B, T, S, D, H = 2, 5, 4, 8, 2


def forms(name):
    """Every combination of the variant's form options (one empty form for the others)."""
    grid = FORMS.get(name, {})
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    for form in combos + [dict(f) for f in EXTRA.get(name, [])]:
        if form.get("amortize") or form.get("merge") == "concat":
            form["seq_len"] = T
        yield form


def masks():
    """(label, call kwargs) of each masking scenario."""
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, -2:] = True
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    general = torch.zeros(T, T, dtype=torch.bool)
    general[0, 2] = general[3, 1] = general[4, 0] = True
    return [("none", {}), ("pad", {"key_padding_mask": pad}), ("causal", {"attn_mask": causal}),
            ("general", {"attn_mask": general}), ("cross", {"context": "context"})]


def layer_options(name, form: dict) -> tuple[object, dict]:
    """(what to build, its options) of a case: the options as they were spelled, or, in a checkout with recipes, the
    recipe (separate maps and the softmax mean: "encoder-swap"), object (a mean, a covariance) or research probe that
    builds the same model."""
    from gpattn.attention import registry

    options = {**FIXED.get(name, {}), **form}
    if "out-of-scope" not in getattr(registry, "RECIPES", ()):
        return name, options
    import functools

    from gpattn.variational import covariances, means

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "research"))
    import knobs

    qk, gp_input = options.pop("qk", "shared"), options.pop("gp_input", None)
    weight = {k: options.pop(k) for k in ("data_weight",) if k in options}
    if qk == "separate":
        options["recipe"] = "encoder-swap"
        options.setdefault("prior_mean", "attention")  # the recipe's own mean is the softmax one
        if name == "sgpa-rff":
            options.setdefault("lengthscale", None)  # the recipe's own ℓ is 1: the case's is the layer's default
        if options["prior_mean"] == "softmax":
            del options["prior_mean"]
    if options.get("prior_mean") == "softmax" and name in ("sgpa", "sgpa-decoupled", "sgpa-rff"):
        options["prior_mean"] = means.SoftmaxMean()
    if gp_input is not None:
        cls = {"query": covariances.TrainingQueryCovariance, "sequence": covariances.TrainingSequenceCovariance}
        options["covariance"] = functools.partial(cls[gp_input], **weight)
    if name == "cgp" and options.get("prior_mean") == "softmax-separate":
        options["prior_mean"] = means.CorrelatedSeparateSoftmaxMean()
    if name == "scgp" and options.get("prior_mean") == "softmax":
        options["prior_mean"] = means.CorrelatedSoftmaxMean()
    probe = knobs.PROBES.get(name)
    knobs_given = probe is not None and set(options) & {"token_independent", "include_residual", "feature_gradient",
                                                        "prior_samples", "learn_sigma"}
    return (probe if knobs_given else name), options


def record(name, form, dtype):
    """The fingerprint of one variant, form and dtype: a dict of tensors and strings."""
    out = {}
    built, options = layer_options(name, form)
    torch.manual_seed(0)
    layer = gpattn.build_attention(built, D, H, **options).to(dtype)
    torch.manual_seed(1)
    x = torch.randn(B, T, D, dtype=dtype)
    context = torch.randn(B, T if form.get("amortize") else S, D, dtype=dtype)
    for label, kwargs in masks():
        if "context" in kwargs:
            kwargs = {"context": context}
        try:
            torch.manual_seed(2)
            layer.train()
            y = layer(x, **kwargs)
            terms = layer.loss_terms()
            out[f"{label}/train"] = y.detach()
            for k, v in terms.items():
                out[f"{label}/loss/{k}"] = v.detach()
            if label in ("none", "pad"):
                layer.zero_grad()
                scalar = (y * torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)).sum()
                scalar = scalar + sum(v.sum() for v in terms.values())
                scalar.backward()
                for k, p in layer.named_parameters():
                    out[f"{label}/grad/{k}"] = None if p.grad is None else p.grad.detach().clone()
            with torch.no_grad(), gpattn.deterministic():
                out[f"{label}/det"] = layer(x, **kwargs).detach()
        except Exception as error:  # a form that refuses a mask: the refusal is part of the fingerprint
            out[f"{label}/error"] = f"{type(error).__name__}: {error}"
    if hasattr(layer, "posterior"):
        try:
            with torch.no_grad():
                post = layer.posterior(x)
            out["posterior/mean"], out["posterior/variance"] = post.mean, post.variance
        except Exception as error:
            out["posterior/error"] = f"{type(error).__name__}: {error}"
    for k, v in layer.state_dict().items():
        out[f"state/{k}"] = v.detach().clone()
    return out


def fingerprint():
    result = {}
    for name in gpattn.list_attention():
        for form in forms(name):
            for dtype in (torch.float32, torch.float64):
                key = f"{name}|{sorted(form.items())}|{dtype}"
                result[key] = record(name, form, dtype)
    return result


def _moved_keys(case: dict) -> dict:
    """``case`` with the state-dict keys that moved (gpattn._migrate.OLD_KEYS, when this checkout has it) renamed,
    so that a fingerprint recorded before the move compares key by key."""
    from gpattn import _migrate

    out = dict(case)
    for _, _, old, new in getattr(_migrate, "OLD_KEYS", ()):
        for key in [k for k in out if k.startswith("state/") and k.endswith("." + old)]:
            out.setdefault(key[: -len(old)] + new, out.pop(key))
    return out


def compare(after, before) -> int:
    """Print per case the max abs diff (and any key, shape or string difference); return the number of
    cases that differ beyond bit-identity. A state-dict key that moved is compared under its new name."""
    before = {case: _moved_keys(fp) for case, fp in before.items()}
    differing = 0
    worst = {}
    for case in sorted(set(before) | set(after)):
        a, b = after.get(case), before.get(case)
        if a is None or b is None:
            print("MISSING", case, "after" if a is None else "before")
            differing += 1
            continue
        if set(a) != set(b):
            print("KEYS", case, sorted(set(a) ^ set(b)))
            differing += 1
        diff = 0.0
        for k in set(a) & set(b):
            va, vb = a[k], b[k]
            if torch.is_tensor(va) and torch.is_tensor(vb):
                if va.shape != vb.shape or va.dtype != vb.dtype:
                    print("SHAPE", case, k, va.shape, vb.shape)
                    differing += 1
                    continue
                same_nan = torch.equal(va.isnan(), vb.isnan()) if va.is_floating_point() else True
                if not same_nan:
                    diff = float("inf")
                elif not torch.equal(va.nan_to_num(), vb.nan_to_num()):
                    diff = max(diff, (va.double() - vb.double()).nan_to_num().abs().max().item(), 1e-300)
            elif va != vb:
                print("VALUE", case, k, repr(va)[:200], repr(vb)[:200])
                differing += 1
        worst[case] = diff
        if diff:
            differing += 1
    for case, diff in worst.items():
        print(f"{diff:.3e}  {case}")
    print(f"{len(worst)} cases, {differing} differ; max abs diff {max(worst.values(), default=0.0):.3e}")
    return differing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--compare", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"gpattn from {gpattn.__file__}")
    result = fingerprint()
    torch.save(result, args.out)
    print(f"saved {len(result)} cases to {args.out}")
    if args.compare:
        return int(compare(result, torch.load(args.compare, weights_only=False)) > 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

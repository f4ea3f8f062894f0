r"""Kernel specs: the serialisable form of every ``kernel=`` option, and the factory that builds them.

A spec is plain JSON (it goes into ``config.json``, the CLI's ``--attention-option kernel=...`` and
checkpoints; docs/kernels.md):

* a name: ``"exponential"``, ``"ard-rbf"``, ``"canonical-rbf"`` or ``"matern"`` (:data:`KERNEL_NAMES`);
* a name with options: ``{"name": "ard-rbf", "lengthscale": 2.0}`` (:data:`KERNEL_OPTIONS`), among them
  gpytorch priors on the hyper-parameters, each a spec of :data:`PRIOR_OPTIONS`:
  ``{"name": "ard-rbf", "lengthscale_prior": {"name": "gamma", "concentration": 3.0, "rate": 6.0}}`` (their
  log density enters the objective as ``log_prior``, gpattn.objectives.DeepGPELBO);
* a composition: ``{"name": "sum" | "product", "kernels": [spec, spec, ...]}`` (gpytorch's
  ``AdditiveKernel`` / ``ProductKernel``) or ``{"name": "scale", "base": spec, "outputscale": 0.1}``
  (``ScaleKernel``).

Every kernel is built with ``batch_shape = (H,)`` (hyper-parameters per head) and, where it has
lengthscales, ``ard_num_dims = Dh``. ``"rbf"``, the name old configs used for both, is an error naming
the two (a saved config migrates it: :data:`gpattn._migrate.OLD_VALUES`).
"""

from __future__ import annotations

import math

import torch
from gpytorch.kernels import AdditiveKernel, Kernel, MaternKernel, ProductKernel, RBFKernel, ScaleKernel
from gpytorch.priors import GammaPrior, HalfCauchyPrior, LogNormalPrior, NormalPrior, Prior

from gpattn.kernels._scale import check_prior_factor, exponential_lengthscale
from gpattn.kernels.cross_covariance import CanonicalRBFKernel
from gpattn.kernels.exponential import ExponentialKernel

__all__ = [
    "KERNEL_NAMES",
    "KERNEL_OPTIONS",
    "PRIOR_OPTIONS",
    "check_kernel",
    "kernel_spec",
    "make_kernel",
    "require_kernel_spec",
    "scale_prior_variance",
]

#: options of each kernel name (every value a number > 0; ``nu`` one of :data:`MATERN_NU`)
KERNEL_OPTIONS = {
    "ard-rbf": ("lengthscale", "outputscale", "lengthscale_prior", "outputscale_prior"),
    "canonical-rbf": (),
    "exponential": ("lengthscale", "outputscale", "lengthscale_prior", "outputscale_prior"),
    "matern": ("lengthscale", "nu", "lengthscale_prior"),
    "product": ("kernels",),
    "scale": ("base", "outputscale", "outputscale_prior"),
    "sum": ("kernels",),
}
#: the gpytorch priors a kernel spec can put on a hyper-parameter, with their parameters (numbers; all but
#: ``loc`` > 0): ``{"name": "gamma", "concentration": 3.0, "rate": 6.0}``
PRIOR_OPTIONS = {
    "gamma": ("concentration", "rate"),
    "halfcauchy": ("scale",),
    "lognormal": ("loc", "scale"),
    "normal": ("loc", "scale"),
}
_PRIOR_CLASSES = {"gamma": GammaPrior, "halfcauchy": HalfCauchyPrior, "lognormal": LogNormalPrior,
                  "normal": NormalPrior}
#: the kernels a name builds (the other keys of :data:`KERNEL_OPTIONS` compose them)
KERNEL_NAMES = ("ard-rbf", "canonical-rbf", "exponential", "matern")
#: the stationary names (κ(x, x) does not depend on x); sums, products and scales of them are too
#: the kernel names whose prior variance is a constant (``stationary=True`` accepts only these)
STATIONARY = ("ard-rbf", "canonical-rbf", "matern")
MATERN_NU = (0.5, 1.5, 2.5)
_REQUIRED = {"product": "kernels", "scale": "base", "sum": "kernels"}
_SCALED = ("ard-rbf", "exponential", "scale")  # names with an outputscale


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _parse(spec, where: str, stationary: bool = False) -> tuple[str, dict, list]:
    """(name, leaf options, parsed children) of ``spec``; errors name ``where``, e.g. kernel['kernels'][1]."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(
            f"{where} must be a kernel name ({', '.join(KERNEL_NAMES)}), a dict {{'name': ..., option: value}} or a "
            f"gpytorch.kernels.Kernel, got {spec!r}"
        )
    name = spec["name"]
    if name == "rbf":
        raise ValueError(
            f"{where}: 'rbf' names two kernels; use 'ard-rbf' (ScaleKernel(RBFKernel(ard_num_dims=Dh)), SGPA and "
            f"kernel attention on images) or 'canonical-rbf' (exp(-|a-b|^2/2) without parameters, CGPT's kappa_o)"
        )
    if name not in KERNEL_OPTIONS:
        raise ValueError(f"{where}: unknown kernel name {name!r}; valid: {', '.join(sorted(KERNEL_OPTIONS))}")
    if stationary and name in KERNEL_NAMES and name not in STATIONARY:
        raise ValueError(
            f"{where}: kernel {name!r} is not stationary, and this layer needs a stationary kernel (kappa(x, x) "
            f"constant, so that the layer's own scales set the prior variances); use {', '.join(STATIONARY)} "
            f"or their sum, product or scale"
        )
    options = {k: v for k, v in spec.items() if k != "name"}
    unknown = sorted(set(options) - set(KERNEL_OPTIONS[name]))
    if unknown:
        valid = ", ".join(KERNEL_OPTIONS[name]) or "none"
        raise ValueError(f"{where}: unknown option(s) {unknown} for kernel {name!r}; valid: {valid}")
    if name in _REQUIRED and _REQUIRED[name] not in options:
        raise ValueError(f"{where}: kernel {name!r} needs {_REQUIRED[name]!r}, got {spec!r}")
    children = []
    if name == "scale":
        children = [_parse(options.pop("base"), f"{where}['base']", stationary)]
    elif name in ("sum", "product"):
        parts = options.pop("kernels")
        if not isinstance(parts, (list, tuple)) or len(parts) < 2:
            raise ValueError(f"{where}['kernels'] must be a list of at least two kernel specs, got {parts!r}")
        children = [_parse(p, f"{where}['kernels'][{i}]", stationary) for i, p in enumerate(parts)]
    for key, val in options.items():
        if key.endswith("_prior"):
            options[key] = _parse_prior(val, f"{where}[{key!r}]")
            continue
        if key == "nu" and val not in MATERN_NU:
            raise ValueError(f"{where}['nu'] must be one of {list(MATERN_NU)}, got {val!r}")
        if key != "nu" and not (_is_number(val) and val > 0):
            raise ValueError(f"{where}[{key!r}] must be a number > 0, got {val!r}")
    return name, options, children


def _parse_prior(spec, where: str) -> dict:
    """A prior spec (:data:`PRIOR_OPTIONS`) checked: its name, every parameter given, numbers in range."""
    if not isinstance(spec, dict) or spec.get("name") not in PRIOR_OPTIONS:
        raise ValueError(
            f"{where} must be a prior spec {{'name': one of {sorted(PRIOR_OPTIONS)}, parameter: number, ...}}, e.g. "
            f"{{'name': 'gamma', 'concentration': 3.0, 'rate': 6.0}}; got {spec!r}"
        )
    name, params = spec["name"], {k: v for k, v in spec.items() if k != "name"}
    wanted = PRIOR_OPTIONS[name]
    if set(params) != set(wanted):
        raise ValueError(f"{where}: the {name!r} prior takes exactly {list(wanted)}, got {sorted(params)}")
    for key, val in params.items():
        if not _is_number(val) or (key != "loc" and val <= 0):
            want = "finite number" if key == "loc" else "number > 0"
            raise ValueError(f"{where}[{key!r}] must be a {want}, got {val!r}")
    return {"name": name, **params}


def _prior(options: dict, key: str) -> Prior | None:
    """The gpytorch prior of a parsed spec's option ``key`` (None when the spec sets none)."""
    spec = options.get(key)
    if spec is None:
        return None
    return _PRIOR_CLASSES[spec["name"]](**{k: float(v) for k, v in spec.items() if k != "name"})


def _carries_scale(node) -> bool:
    """Whether a parsed spec has an outputscale to put the initial prior variance in."""
    name, _, children = node
    if name in ("sum", "product"):
        agree = all if name == "sum" else any
        return agree(_carries_scale(c) for c in children)
    return name in _SCALED


def _build(node, num_heads: int, head_dim: int, variance: float | None, lengthscale: float | None = None) -> Kernel:
    r"""The kernel of a parsed spec. ``variance``: the prior variance κ(x, x) this node starts with (a
    sum splits it equally between its terms, a product gives it to its first factor with an
    outputscale and 1 to the others, ``scale`` keeps it and builds its base at 1); ``None`` keeps each
    kernel's own initial values. ``lengthscale``: the initial ℓ of the exponential, ARD-RBF and Matérn
    kernels (default √Dh). Explicit options win over both."""
    name, options, children = node
    batch = torch.Size([num_heads])
    priors = {k: _prior(options, k) for k in ("lengthscale_prior", "outputscale_prior") if options.get(k)}
    if name == "exponential":
        kern = ExponentialKernel(ard_num_dims=head_dim, batch_shape=batch, **priors)
        scaled, shaped = kern, kern
        if variance is not None or lengthscale is not None:
            kern.lengthscale = lengthscale or exponential_lengthscale(head_dim)
    elif name in ("ard-rbf", "matern"):
        shape_prior = {k: v for k, v in priors.items() if k == "lengthscale_prior"}
        shaped = (
            RBFKernel(ard_num_dims=head_dim, batch_shape=batch, **shape_prior)
            if name == "ard-rbf"
            else MaternKernel(nu=options.get("nu", 2.5), ard_num_dims=head_dim, batch_shape=batch, **shape_prior)
        )
        shaped.lengthscale = lengthscale or float(head_dim) ** 0.5
        scale_prior = {k: v for k, v in priors.items() if k == "outputscale_prior"}
        kern = scaled = ScaleKernel(shaped, batch_shape=batch, **scale_prior) if name == "ard-rbf" else shaped
    elif name == "canonical-rbf":
        kern = scaled = shaped = CanonicalRBFKernel(batch_shape=batch)
    elif name == "scale":
        base = _build(children[0], num_heads, head_dim, None if variance is None else 1.0, lengthscale)
        kern = scaled = ScaleKernel(base, batch_shape=batch, **priors)
        shaped = None
    else:  # sum, product
        if variance is None:
            shares = [None] * len(children)
        elif name == "sum":
            shares = [variance / len(children)] * len(children)
        else:
            first = next((i for i, c in enumerate(children) if _carries_scale(c)), None)
            shares = [variance if i == first else 1.0 for i in range(len(children))]
        parts = [_build(c, num_heads, head_dim, v, lengthscale) for c, v in zip(children, shares)]
        return AdditiveKernel(*parts) if name == "sum" else ProductKernel(*parts)
    if variance is not None and name in _SCALED:
        scaled.outputscale = variance
    if "outputscale" in options:
        scaled.outputscale = float(options["outputscale"])
    if "lengthscale" in options:
        shaped.lengthscale = float(options["lengthscale"])
    return kern


def _kernel_children(kernel: Kernel):
    """The kernels directly inside ``kernel`` (a ScaleKernel's base, a sum's terms, ...)."""
    for child in kernel.children():
        if isinstance(child, Kernel):
            yield child
        elif isinstance(child, torch.nn.ModuleList):
            yield from (c for c in child if isinstance(c, Kernel))


def _check_width(kernel: Kernel, width: int, head_dim: int, where: str, applied=None) -> None:
    """``width``: the input width ``kernel`` receives; ``applied``: the active_dims that produced it (a
    ScaleKernel shares its base's, which are then not applied twice)."""
    if kernel.active_dims is not None and not (applied is not None and torch.equal(kernel.active_dims, applied)):
        dims = kernel.active_dims.tolist()
        if dims and not all(0 <= d < width for d in dims):
            raise ValueError(
                f"{where}: {type(kernel).__name__} has active_dims={dims}, but its inputs have {width} dimensions "
                f"(the head width Dh = embed_dim / num_heads = {head_dim}); use indices in [0, {width})"
            )
        width = len(dims)
    if kernel.ard_num_dims is not None and kernel.ard_num_dims != width:
        raise ValueError(
            f"{where}: {type(kernel).__name__} has ard_num_dims={kernel.ard_num_dims}, but an attention kernel sees "
            f"one head's projected tokens, of width {width} (Dh = embed_dim / num_heads = {head_dim}, not embed_dim); "
            f"build it with ard_num_dims={width}"
        )
    for child in _kernel_children(kernel):
        _check_width(child, width, head_dim, where, kernel.active_dims)


def _has_scale(kernel: Kernel) -> bool:
    """Whether κ(x, x) of a kernel instance can be scaled through outputscales (as :func:`_carries_scale`)."""
    if isinstance(kernel, AdditiveKernel):
        return all(_has_scale(k) for k in kernel.kernels)
    if isinstance(kernel, ProductKernel):
        return any(_has_scale(k) for k in kernel.kernels)
    return hasattr(kernel, "raw_outputscale")


@torch.no_grad()
def scale_prior_variance(kernel: Kernel, factor: float, *, name: str = "kernel") -> None:
    """Multiply the prior variance κ(x, x) of ``kernel`` by ``factor`` in place, through its outputscale(s):
    a ``ScaleKernel`` or :class:`ExponentialKernel` scales its own, a sum every term's, a product its first
    factor's that has one (as ``make_kernel``'s ``prior_variance`` places it). The kernel's shape
    (lengthscales, correlations) is unchanged.

    :raises ValueError: ``factor`` is not a number > 0, or ``kernel`` has no outputscale where one is
        needed (wrap it in a ``ScaleKernel``)."""
    factor = check_prior_factor(factor)
    if not _has_scale(kernel):
        raise ValueError(
            f"{name}: {type(kernel).__name__} has no outputscale to scale its prior variance by (a sum needs one "
            f"in every term, a product in one factor); wrap it in gpytorch.kernels.ScaleKernel"
        )
    if isinstance(kernel, AdditiveKernel):
        for k in kernel.kernels:
            scale_prior_variance(k, factor, name=name)
    elif isinstance(kernel, ProductKernel):
        scale_prior_variance(next(k for k in kernel.kernels if _has_scale(k)), factor, name=name)
    else:
        kernel.outputscale = kernel.outputscale * factor


def check_kernel(kernel: Kernel, num_heads: int, head_dim: int, *, name: str = "kernel") -> None:
    """Refuse, at layer construction, a kernel instance that cannot take a layer's inputs ``(B, H, T, Dh)``:
    a batch shape that does not broadcast against ``(B, H)`` without changing it, or a kernel (or a kernel
    inside it) whose ``ard_num_dims`` / ``active_dims`` do not fit the head width Dh."""
    shape = tuple(kernel.batch_shape)
    try:
        fits = torch.broadcast_shapes(torch.Size(shape), torch.Size([1, num_heads])) == (1, num_heads)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"{name}: batch_shape {shape} does not broadcast against the layer's (B, H) with num_heads = {num_heads}; "
            f"use batch_shape=torch.Size([{num_heads}]) (one set of hyper-parameters per head) or torch.Size([])"
        )
    _check_width(kernel, head_dim, head_dim, name)


def make_kernel(
    kernel,
    num_heads: int,
    head_dim: int,
    *,
    prior_variance: float | None = None,
    lengthscale: float | None = None,
    stationary: bool = False,
    name: str = "kernel",
) -> Kernel:
    """The per-head kernel of a layer with ``num_heads`` heads of width ``head_dim`` from a spec (module
    docstring) or a gpytorch ``Kernel`` instance (checked by :func:`check_kernel`, then used as given).

    :param prior_variance: start a kernel built from a spec on the scale of the residual stream
        (:mod:`gpattn.variational._scale`): κ(x, x) ≈ ``prior_variance`` through the outputscale(s),
        and ℓ = √Dh for the exponential kernel (the others always start at ℓ = √Dh). ``None`` keeps the
        kernels' own initial values (the kernel-attention baselines). Kernels without an outputscale
        (``"canonical-rbf"``, ``"matern"``) keep κ(x, x) = 1: wrap them in ``"scale"``.
    :param lengthscale: the initial ℓ of the exponential, ARD-RBF and Matérn kernels of a spec, in place of
        √Dh (a spec's own ``lengthscale`` option wins).
    :param stationary: accept only stationary specs (:data:`STATIONARY` and their compositions) and
        kernel instances whose ``is_stationary`` is True.
    :param name: the argument's name in error messages.
    """
    if isinstance(kernel, Kernel):
        check_kernel(kernel, num_heads, head_dim, name=name)
        if stationary and not kernel.is_stationary:
            raise ValueError(
                f"{name}: {type(kernel).__name__} is not stationary (gpytorch's is_stationary), and this layer needs a "
                f"stationary kernel (kappa(x, x) constant, so that the layer's own scales set the prior variances); "
                f"use an RBF or Matern kernel, CanonicalRBFKernel, or their sum, product or ScaleKernel"
            )
        return kernel
    return _build(_parse(kernel, name, stationary), num_heads, head_dim, prior_variance, lengthscale)


def _uniform(value: torch.Tensor):
    """A tensor's single value as a float (6 significant digits), or None when its entries differ."""
    flat = value.detach().flatten()
    if flat.numel() == 0 or not bool((flat == flat[0]).all()):
        return None
    return float(f"{float(flat[0]):.6g}")


def _prior_specs(kernel: Kernel, *keys: str) -> dict:
    """The specs of ``kernel``'s own priors among ``keys`` (a ``ValueError`` for one no spec builds)."""
    out = {}
    for key in keys:
        entry = kernel._priors.get(key)
        if entry is None:
            continue
        prior = entry[0]
        name = next((n for n, c in _PRIOR_CLASSES.items() if type(prior) is c), None)
        values = {k: _uniform(getattr(prior, k)) for k in PRIOR_OPTIONS.get(name, ())}
        if name is None or any(v is None for v in values.values()):
            raise ValueError(f"{type(kernel).__name__}'s {key} ({type(prior).__name__}) has no prior spec")
        out[key] = {"name": name, **values}
    return out


def kernel_spec(kernel: Kernel):
    """The spec that builds a kernel of the same structure as ``kernel``, with its lengthscales and
    outputscales when all their entries are equal (per-head values are not part of a spec). Raises
    ``ValueError`` for a kernel that no spec builds (e.g. active_dims, or a class without a name)."""

    def options(**values):
        return {k: v for k, v in values.items() if v is not None}

    if kernel.active_dims is not None:
        raise ValueError(f"{type(kernel).__name__} with active_dims has no kernel spec")
    kind = type(kernel)
    if kind is ExponentialKernel:
        return {
            "name": "exponential",
            **options(lengthscale=_uniform(kernel.lengthscale), outputscale=_uniform(kernel.outputscale)),
            **_prior_specs(kernel, "lengthscale_prior", "outputscale_prior"),
        }
    if kind is CanonicalRBFKernel:
        return "canonical-rbf"
    if kind is MaternKernel:
        return {
            "name": "matern", "nu": kernel.nu, **options(lengthscale=_uniform(kernel.lengthscale)),
            **_prior_specs(kernel, "lengthscale_prior"),
        }
    if kind is ScaleKernel:
        scale = _uniform(kernel.outputscale)
        own = _prior_specs(kernel, "outputscale_prior")
        if type(kernel.base_kernel) is RBFKernel and kernel.base_kernel.active_dims is None:
            return {
                "name": "ard-rbf",
                **options(lengthscale=_uniform(kernel.base_kernel.lengthscale), outputscale=scale),
                **_prior_specs(kernel.base_kernel, "lengthscale_prior"), **own,
            }
        return {"name": "scale", "base": kernel_spec(kernel.base_kernel), **options(outputscale=scale), **own}
    if kind in (AdditiveKernel, ProductKernel):
        return {
            "name": "sum" if kind is AdditiveKernel else "product",
            "kernels": [kernel_spec(k) for k in kernel.kernels],
        }
    raise ValueError(
        f"{kind.__name__} has no kernel spec; specs build {', '.join(KERNEL_NAMES)} and their sum, product and scale"
    )


def require_kernel_spec(kernel, *, name: str = "kernel") -> None:
    """Refuse a gpytorch ``Kernel`` instance where only a spec can go (``TrainConfig``, config.json,
    checkpoints, ``compare``, the CLI), with the spec to pass instead."""
    if not isinstance(kernel, Kernel):
        return
    try:
        hint = f"pass its spec instead: {kernel_spec(kernel)!r}"
    except ValueError as err:
        hint = f"and it has no spec ({err})"
    raise ValueError(
        f"{name} is a gpytorch kernel instance ({type(kernel).__name__}), which config.json cannot store; {hint} "
        f"(docs/kernels.md; per-head values are learned, or set after gpattn.experiments.training.build_model)"
    )

"""Invariants of the attention contract, as plain functions.

``run_attention_invariant(check, name, **options)`` runs one named check on the registered variant
``name`` and raises ``AssertionError`` on failure; :class:`gpattn.testing.BaseAttentionTestCase` makes
them test methods, and ``tests/test_attention_invariants.py`` runs them for every name of
``gpattn.list_attention()``.
"""

from __future__ import annotations

import io
import pickle

import torch

from gpattn._settings import deterministic, validation
from gpattn.attention.registry import attention_class, build_attention
from gpattn.testing.assertions import layer_loss_terms

__all__ = ["ATTENTION_INVARIANTS", "make_inputs", "run_attention_invariant"]


def make_inputs(B=2, T=6, D=8, *, pad=(0, 2), dtype=torch.float32, seed=0):
    """x (B, T, D) and a key_padding_mask (B, T) whose row i pads its last ``pad[i]`` tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=dtype)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(pad[:B]):
        if n:
            mask[i, T - n :] = True
    return x, mask


def _label(name) -> str:
    """A variant's name in messages: the registered name, or a layer class's ``name`` (else its class name)."""
    return name if isinstance(name, str) else attention_class(name).name or name.__name__


def _build(name, D=8, H=2, **options):
    torch.manual_seed(0)
    return build_attention(name, D, H, **options)


def _run(layer, x, mask, seed=1, **kwargs):
    torch.manual_seed(seed)
    return layer(x, mask, **kwargs)


def check_shape(name, **options):
    layer = _build(name, **options)
    x, mask = make_inputs()
    y = _run(layer, x, mask)
    assert y.shape == x.shape, f"{name}: output shape {tuple(y.shape)} != input shape {tuple(x.shape)}"
    assert torch.isfinite(y).all(), f"{name}: non-finite output"
    for key, val in layer_loss_terms(layer).items():
        assert torch.is_tensor(val) and val.dim() == 0, f"{name}: loss term {key} is not a scalar tensor"
        assert torch.isfinite(val), f"{name}: loss term {key} is not finite"


def check_padding(name, **options):
    """Changing padded tokens never changes real tokens' outputs (mean and seeded samples)."""
    layer = _build(name, **options)
    x, mask = make_inputs(pad=(3, 2))
    x2 = x.clone()
    x2[mask] = torch.randn(int(mask.sum()), x.shape[-1]) * 5
    real = ~mask
    with deterministic():
        a, b = layer(x, mask), layer(x2, mask)
    torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=1e-5, msg=f"{name}: padding leaks (mean)")
    a, b = _run(layer, x, mask), _run(layer, x2, mask)
    torch.testing.assert_close(a[real], b[real], rtol=1e-4, atol=1e-4, msg=f"{name}: padding leaks (sample)")


def check_all_padding_row(name, **options):
    """A sequence whose keys are all padding gives zeros, and does not disturb the others."""
    layer = _build(name, **options)
    x, mask = make_inputs(pad=(0, 6))
    y = _run(layer, x, mask)
    assert torch.isfinite(y).all(), f"{name}: all-padding row gives non-finite values"
    assert torch.equal(y[1], torch.zeros_like(y[1])), f"{name}: all-padding row is not zero"
    # in float64: the all-padding row now runs in the same batch (no host read to drop it), so a
    # batch of 2 against a batch of 1 differs by float32 round-off, which scgp's capacitance matrices
    # amplify to ~1e-4 when T < m (measured); the property checked is that the row does not disturb
    layer, x = layer.double(), x.double()
    with deterministic():
        alone = layer(x[:1], None)
        both = layer(x, mask)
    torch.testing.assert_close(both[0], alone[0], rtol=1e-9, atol=1e-9)


def check_gradients(name, **options):
    """Every parameter receives a finite, non-zero gradient from output + loss terms."""
    layer = _build(name, **options)
    layer.train()
    x, mask = make_inputs(B=3, T=7, pad=(0, 2, 4))
    x.requires_grad_(True)
    y = _run(layer, x, mask)
    loss = (y * torch.randn_like(y)).sum() + sum(layer_loss_terms(layer).values(), torch.zeros(()))
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for pname, p in layer.named_parameters():
        assert p.grad is not None, f"{name}: parameter {pname} receives no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}: parameter {pname} has a non-finite gradient"
        assert (p.grad != 0).any(), f"{name}: parameter {pname} has an all-zero gradient"


def check_small_shapes(name, **options):
    """B=1, H=1, T=1 (the released code's undimensioned squeeze bugs)."""
    for B, H, T in ((1, 2, 5), (2, 1, 5), (2, 2, 1), (1, 1, 1)):
        layer = _build(name, D=4 * H, H=H, **options)
        x = torch.randn(B, T, 4 * H)
        y = _run(layer, x, None)
        assert y.shape == (B, T, 4 * H), f"{name}: B={B}, H={H}, T={T} gives shape {tuple(y.shape)}"
        assert torch.isfinite(y).all(), f"{name}: B={B}, H={H}, T={T} gives non-finite values"


def check_empty_batch(name, **options):
    """B=0 is a defined result: an empty output of the right shape, with a usable graph."""
    layer = _build(name, **options)
    x = torch.randn(0, 6, 8)
    y = layer(x, torch.zeros(0, 6, dtype=torch.bool))
    assert y.shape == (0, 6, 8), f"{name}: empty batch gives shape {tuple(y.shape)}"
    y.sum().backward()


def check_float64(name, **options):
    layer = _build(name, **options).double()
    x, mask = make_inputs(dtype=torch.float64)
    y = _run(layer, x, mask)
    assert y.dtype == torch.float64 and torch.isfinite(y).all()
    for key, val in layer_loss_terms(layer).items():
        assert val.dtype == torch.float64, f"{name}: loss term {key} is {val.dtype} in a float64 layer"


def check_bf16_autocast(name, **options):
    """Under bf16 autocast a float32 layer runs forward and backward with finite output, loss terms and
    gradients; loss terms stay float32 (the GP algebra is full precision, DESIGN "Numerics policy")."""
    layer = _build(name, **options)
    x, mask = make_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _run(layer, x, mask)
        terms = layer_loss_terms(layer)
    assert torch.isfinite(y.float()).all(), f"{name}: non-finite output under bf16 autocast"
    for key, val in terms.items():
        assert val.dtype == torch.float32 and torch.isfinite(val), f"{name}: loss term {key} is {val} under bf16"
    (y.float().sum() + sum(terms.values(), torch.zeros(()))).backward()
    for pname, p in layer.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"{name}: non-finite gradient of {pname} under bf16"


def check_pickle(name, **options):
    layer = _build(name, **options)
    x, mask = make_inputs()
    _run(layer, x, mask)  # a forward first: pickling must not trip over the last loss terms
    clone = pickle.loads(pickle.dumps(layer))
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    torch.testing.assert_close(_run(clone, x, mask), _run(layer, x, mask))
    with deterministic():
        torch.testing.assert_close(clone(x, mask), layer(x, mask))


def check_deterministic(name, **options):
    """Under ``gpattn.deterministic()`` two forwards agree; outside, stochastic variants vary."""
    layer = _build(name, **options)
    x, mask = make_inputs()
    with deterministic():
        torch.manual_seed(1)
        a = layer(x, mask)
        torch.manual_seed(2)
        b = layer(x, mask)
    torch.testing.assert_close(a, b)
    c, d = _run(layer, x, mask, seed=1), _run(layer, x, mask, seed=2)
    if attention_class(name).stochastic:
        assert not torch.allclose(c, d), f"{name} is marked stochastic but its samples do not vary"
    else:
        torch.testing.assert_close(c, d)


def check_posterior(name, **options):
    """GP variants: MultivariateNormal with batch (B, H, Dv) and event T whose mean is the
    deterministic head output; others: a clear NotImplementedError."""
    layer = _build(name, **options)
    x, mask = make_inputs()
    if not attention_class(name).is_gp:
        try:
            layer.posterior(x, mask)
        except NotImplementedError as err:
            assert _label(name) in str(err)
            return
        raise AssertionError(f"{name}: posterior() of a non-GP variant did not raise")
    from gpytorch.distributions import MultivariateNormal

    post = layer.posterior(x, mask)
    assert isinstance(post, MultivariateNormal), f"{name}: posterior is {type(post)}"
    H, Dv = layer.num_heads, layer.value_dim
    assert post.batch_shape == (2, H, Dv) and post.event_shape == (6,), (
        f"{name}: posterior batch {tuple(post.batch_shape)} event {tuple(post.event_shape)}"
    )


def _expect_value_error(fn, *words):
    try:
        fn()
    except ValueError as err:
        msg = str(err)
        for w in words:
            assert w in msg, f"error message {msg!r} does not mention {w!r}"
        return
    raise AssertionError(f"no ValueError (expected one mentioning {words})")


def check_errors(name, **options):
    """Clear errors for wrong rank, embed_dim, mask shape/dtype, NaN input and unknown option."""
    layer = _build(name, **options)
    x, mask = make_inputs()
    _expect_value_error(lambda: layer(x[0]), "rank")
    _expect_value_error(lambda: layer(torch.randn(2, 6, 9)), "embed_dim")
    _expect_value_error(lambda: layer(x, mask[:, :5]), "key_padding_mask", "(2, 6)")
    _expect_value_error(lambda: layer(x, mask.float()), "key_padding_mask", "bool")
    for value in (float("nan"), float("inf"), -float("inf")):
        bad = x.clone()
        bad[0, 0, 0] = value
        with validation():  # a value check: it reads the device, so it is opt-in
            _expect_value_error(lambda bad=bad: layer(bad), "NaN or Inf")
    _expect_value_error(lambda: build_attention(name, 8, 2, no_such_option=1), "no_such_option", _label(name))
    _expect_value_error(lambda: build_attention(name, 8, 3, **options), "divisible")


def check_cross_attention(name, **options):
    """Cross-attention (docs/derivations.md §13): queries (B, 4, D) and a context (B, 6, D) give (B, 4, D); under
    ``gpattn.deterministic()`` what the padded keys hold changes nothing and a context equal to x (another
    tensor) is self-attention at the real tokens. A variant without ``cross_attention`` raises a ValueError
    naming it."""
    layer = _build(name, **options)
    context, mask = make_inputs()
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(3))
    if not attention_class(name).cross_attention:
        _expect_value_error(lambda: layer(x, mask, context=context), "cross-attention", _label(name))
        return
    y = _run(layer, x, mask, context=context)
    assert y.shape == x.shape and torch.isfinite(y).all(), f"{name}: cross-attention output {tuple(y.shape)}"
    garbage = context.clone()
    garbage[mask] = torch.randn(int(mask.sum()), context.shape[-1]) * 5  # as check_padding
    torch.testing.assert_close(_run(layer, x, mask, context=garbage), y, rtol=1e-4, atol=1e-4)  # seeded samples
    with deterministic():
        y = layer(x, mask, context=context)
        torch.testing.assert_close(layer(x, mask, context=garbage), y, rtol=1e-4, atol=1e-5)
        real = ~mask[..., None]
        y_self, y_cross = layer(context, mask), layer(context, mask, context=context.clone())
        torch.testing.assert_close(y_cross * real, y_self * real, rtol=1e-4, atol=1e-5)


#: every invariant check of :class:`gpattn.testing.BaseAttentionTestCase`, by name
ATTENTION_INVARIANTS = {
    f.__name__.removeprefix("check_"): f
    for f in (
        check_shape,
        check_padding,
        check_all_padding_row,
        check_gradients,
        check_small_shapes,
        check_empty_batch,
        check_float64,
        check_bf16_autocast,
        check_pickle,
        check_deterministic,
        check_posterior,
        check_errors,
        check_cross_attention,
    )
}


def run_attention_invariant(check: str, name: str, **options) -> None:
    """Run the invariant ``check`` (a key of ``ATTENTION_INVARIANTS``) on variant ``name`` (a registered
    name, or an attention layer class: :func:`gpattn.attention.build_attention` takes either)."""
    if check not in ATTENTION_INVARIANTS:
        raise ValueError(f"unknown check {check!r}; valid: {', '.join(ATTENTION_INVARIANTS)}")
    ATTENTION_INVARIANTS[check](name, **options)

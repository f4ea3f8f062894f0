"""The fused Gumbel-softmax attention path (docs/derivations.md §12, "Fused Gumbel noise on CUDA"):
the counter-based noise's law, FlexAttention with its ``score_mod`` against a dense reference with the
same noise, and the predicate that chooses the path.

The noise and the eager FlexAttention forward are tested on the CPU; the tests marked ``cuda`` need a GPU
(the compiled kernel, its gradients, its memory) and are skipped without one:
``pytest -q tests/test_gumbel_fused.py`` on a CUDA machine runs them all. Monte-Carlo checks use level
1e-4 (goodness of fit) and 5 standard errors (moments, correlations).
"""

import math
import shutil
import types

import pytest
import torch
from scipy import stats

import gpattn
import gpattn.variational._blockwise as bw
from gpattn.attention import _gumbel
from gpattn.attention._counter_noise import _mix, _mul32, counter_gumbel, counter_gumbel_grid, noise_tables
from gpattn.attention._gumbel import (
    _compiled_fused,
    _compiled_tables,
    _fused_soft_attention,
    fused_path,
    gumbel_attention,
)
from gpattn.variational._blockwise import block_seeds

EULER_GAMMA = 0.5772156649015329
GUMBEL_VAR = math.pi**2 / 6
EAGER_FLEX = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
# Inductor's own imports under the project's warnings-as-errors
INDUCTOR = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
# the compiler stack on a GPU machine (Triton, Inductor) may warn about its own deprecations: not ours to fix
GPU_COMPILER = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled FlexAttention kernel needs CUDA")


def _seed(s: int) -> torch.Tensor:
    return torch.tensor(s, dtype=torch.int64)


def _gumbel_cdf(g: torch.Tensor) -> torch.Tensor:
    return torch.exp(-torch.exp(-g.double()))


# ------------------------------------------------------------------------------------ integer arithmetic
def _lowbias32_reference(x: int) -> int:
    """lowbias32 in Python's unbounded integers (an independent statement of the mixer)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def test_32_bit_products_and_mixer_match_unbounded_integers():
    """The int64 16-bit-halves product is x·c mod 2³² for words up to 2³² − 1 (where a plain int64 product
    overflows), and the mixer equals its statement in Python integers."""
    g = torch.Generator().manual_seed(0)
    words = torch.cat([torch.randint(0, 2**32, (2000,), generator=g), torch.tensor([0, 1, 2**31, 2**32 - 1])])
    for c in (0x7FEB352D, 0x846CA68B, 0xFFFFFFFF):
        assert _mul32(words, c).tolist() == [(w * c) % 2**32 for w in words.tolist()]
    assert _mix(words).tolist() == [_lowbias32_reference(w) for w in words.tolist()]


# --------------------------------------------------------------------------------------- the noise's law
def _check_gumbel_sample(g: torch.Tensor):
    """Mean γ, variance π²/6 (5 standard errors), Kolmogorov–Smirnov against the Gumbel CDF."""
    g = g.double().flatten()
    n = g.numel()
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - EULER_GAMMA) < 5 * math.sqrt(GUMBEL_VAR / n)
    # Var of the sample variance of a Gumbel: (μ4 − σ⁴)/n with excess kurtosis 12/5
    assert abs(g.var().item() - GUMBEL_VAR) < 5 * math.sqrt((12 / 5 + 2) * GUMBEL_VAR**2 / n)
    ks = stats.kstest(g.numpy(), stats.gumbel_r.cdf)
    assert ks.pvalue > 1e-4, ks


def test_noise_over_many_counters_is_gumbel():
    """One seed, 2·4·160·160 counters: the pooled sample has the Gumbel law; float32, on the grid's range."""
    g = counter_gumbel_grid(_seed(12345), 2, 4, 160, 160)
    assert g.shape == (2, 4, 160, 160) and g.dtype == torch.float32
    assert g.min() >= -math.log(-math.log(2.0**-24)) - 1e-5 and g.max() <= -math.log(-math.log1p(-(2.0**-24))) + 1e-3
    _check_gumbel_sample(g)


@pytest.mark.parametrize("entry", [(0, 0, 0, 0), (1, 3, 17, 65535), (7, 0, 65535, 1)])
def test_each_entry_is_gumbel_over_seeds(entry):
    """A fixed entry (b, h, i, j) over 100,000 seeds (consecutive, the worst case): the Gumbel law per entry."""
    seeds = torch.arange(100_000, dtype=torch.int64) + 2**40
    b, h, i, j = (torch.tensor(w, dtype=torch.int32) for w in entry)
    _check_gumbel_sample(counter_gumbel(seeds, b, h, i, j))


def _pairs_are_independent(x: torch.Tensor, y: torch.Tensor, bins: int = 8):
    """Correlation 0 within 5 standard errors, and a chi-square test of the bins×bins contingency table of
    the Gumbel-CDF bins against the product of the uniform marginals (level 1e-4)."""
    x, y = x.flatten().double(), y.flatten().double()
    n = x.numel()
    r = torch.corrcoef(torch.stack([x, y]))[0, 1].item()
    assert abs(r) < 5 / math.sqrt(n), r
    cells = (_gumbel_cdf(x) * bins).long().clamp_(max=bins - 1) * bins + (_gumbel_cdf(y) * bins).long().clamp_(
        max=bins - 1
    )
    table = torch.bincount(cells, minlength=bins * bins).double().numpy()
    chi2 = stats.chisquare(table)  # expected n / bins² per cell
    assert chi2.pvalue > 1e-4, chi2


@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_neighbouring_entries_are_independent(axis):
    """Entries one step apart along b, h, i or j (the counters that differ least) are uncorrelated and
    independent by a contingency chi-square."""
    g = counter_gumbel_grid(_seed(2024), 4, 4, 96, 96)
    first = g.narrow(axis, 0, g.shape[axis] - 1)
    second = g.narrow(axis, 1, g.shape[axis] - 1)
    _pairs_are_independent(first, second)


def test_neighbouring_seeds_are_independent_and_seeds_reproduce():
    """Seeds s and s + 1 give independent noise; the same seed gives the same noise, bit for bit."""
    a = counter_gumbel_grid(_seed(77), 2, 2, 128, 128)
    b = counter_gumbel_grid(_seed(78), 2, 2, 128, 128)
    _pairs_are_independent(a, b)
    assert torch.equal(a, counter_gumbel_grid(_seed(77), 2, 2, 128, 128))
    assert (a != b).float().mean() > 0.99
    high = counter_gumbel_grid(_seed(77 + 2**32), 2, 2, 128, 128)  # the seed's high word counts too
    assert (a != high).float().mean() > 0.99


def test_scalar_int32_counters_agree_with_the_grid():
    """The score_mod's call (0-dim int32 indices) gives the grid's (int64 arange) entry."""
    seed = _seed(2**61 + 5)
    grid = counter_gumbel_grid(seed, 3, 2, 5, 7)
    for b, h, i, j in [(0, 0, 0, 0), (2, 1, 4, 6), (1, 0, 3, 2)]:
        idx = [torch.tensor(w, dtype=torch.int32) for w in (b, h, i, j)]
        assert torch.equal(counter_gumbel(seed, *idx), grid[b, h, i, j])


# ---------------------------------------------------------------------- the score_mod against a reference
def _dense_reference(q, k, v, tau, seed, padding):
    """softmax((q kᵀ + G)/τ) v in float64 with G = counter_gumbel on the whole (B, H, T, S) grid."""
    B, H, T = q.shape[:3]
    S = k.shape[-2]
    logits = q.double() @ k.double().transpose(-1, -2) + counter_gumbel_grid(seed.to(q.device), B, H, T, S).double()
    if padding is not None:
        logits = logits.masked_fill(padding[:, None, None, :], float("-inf"))
    return torch.softmax(logits / tau, dim=-1) @ v.double()


def _fused(fn, q, k, v, seed, padding, inv_tau):
    """``fn`` (the eager or the compiled kernel) with the noise tables of ``seed`` on q's device."""
    rows, columns = noise_tables(seed.to(q.device), *q.shape[:3], k.shape[-2])
    return fn(q, k, v, rows, columns, padding, inv_tau.to(q.device))


def _inputs(dtype, device="cpu", B=2, H=3, T=9, S=11, D=16, Dv=8, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, d, generator=g, dtype=dtype) for n, d in ((T, D), (S, D), (S, Dv)))
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[0, -3:] = True  # the last keys of the first sequence, the first keys of the second
    padding[1:, :2] = True
    return [t.to(device).requires_grad_(requires_grad) for t in (q, k, v)] + [padding.to(device)]


@EAGER_FLEX
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("padded", [True, False])
def test_score_mod_equals_dense_reference_on_cpu(dtype, tol, padded):
    """FlexAttention's eager forward with the fused path's score_mod equals the dense Gumbel-softmax with the
    same noise (cross-attention shapes T ≠ S, Dv ≠ D; key padding at −∞)."""
    q, k, v, padding = _inputs(dtype)
    padding = padding if padded else None
    tau, seed = 0.7, _seed(987654321)
    inv_tau = torch.tensor(1 / tau, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    out = _fused(_fused_soft_attention, q, k, v, seed, padding, inv_tau)
    ref = _dense_reference(q, k, v, tau, seed, padding)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    # the noise matters: another seed gives another output
    other = _fused(_fused_soft_attention, q, k, v, _seed(1), padding, inv_tau)
    assert not torch.allclose(other.double(), ref, atol=1e-3)


@INDUCTOR
@pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")), reason="Inductor on the CPU needs a C++ compiler"
)
def test_compiled_tables_and_kernel_compile_on_cpu_and_a_new_seed_does_not_recompile():
    """The compiled noise tables have the eager tables' bits; the kernel compiles on the CPU (Inductor's C++
    FlexAttention: a guard against the score_mod growing past what Inductor compiles in seconds, ~15 s here) and a
    second seed reuses both compiled graphs.

    The kernel's *values* are checked against the dense reference by the CUDA tests below (the Triton kernel, the
    one the fused path runs) and, for the score_mod, by FlexAttention's eager reference above. Inductor's CPU
    kernel (torch 2.13) is not checked for values: its output depended on the heap's prior contents (one or a few
    query rows of the last (batch, head) wrong or NaN after any earlier allocation, even in a fresh interpreter after
    imports; clamping the score_mod's indices to the tables changed nothing), an upstream defect of a path gpattn
    never takes (:func:`fused_path` refuses CPU tensors)."""
    q, k, v, padding = _inputs(torch.float32, T=40, S=40)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed in (_seed(11), _seed(2**61 + 12)):
        out = _fused(_compiled_fused(), q, k, v, seed, padding, torch.tensor(1 / 0.7))
        assert out.shape == (2, 3, 40, 8) and out.dtype == torch.float32
        for got, want in zip(_compiled_tables()(seed, 2, 3, 40, 40), noise_tables(seed, 2, 3, 40, 40)):
            assert torch.equal(got, want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 2  # the kernel and the tables


# ------------------------------------------------------------------------------------------- the predicate
def _like(device="cuda", dtype=torch.float32, head_dim=16):
    """A stand-in with the attributes fused_path reads (device, dtype, shape): the predicate is tested on
    machines without CUDA."""
    return types.SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(2, 2, 8, head_dim))


def test_fused_path_predicate(monkeypatch):
    """The fused kernel runs exactly for CUDA soft samples without weights, in float32/16/bf16, with no mask
    or key padding, head dimensions ≥ 16, FlexAttention and Triton present, and a sequence long enough to be
    cut into query blocks."""
    soft = dict(mask=None, hard=False, sample=True, return_weights=False)
    monkeypatch.setattr(_gumbel, "_FUSED_AVAILABLE", True)
    assert not fused_path(_like(), _like(), _like(), **soft)  # short: the noise tensor and SDPA
    monkeypatch.setattr(bw, "DEVICE_BLOCK_ELEMENTS", 1)  # every length is long
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert fused_path(_like(dtype=dtype), _like(dtype=dtype), _like(dtype=dtype), **soft)
    assert fused_path(_like(), _like(), _like(), **{**soft, "mask": torch.zeros(2, 8, dtype=torch.bool)})
    refused = [
        ((_like("cpu"), _like("cpu")), {}),
        ((_like(dtype=torch.float64), _like(dtype=torch.float64)), {}),
        ((_like(), _like()), {"hard": True}),
        ((_like(), _like()), {"sample": False}),
        ((_like(), _like()), {"return_weights": True}),
        ((_like(), _like()), {"mask": torch.zeros(2, 1, 8, 8, dtype=torch.bool)}),
        ((_like(head_dim=8), _like()), {}),
        ((_like(), _like(head_dim=8)), {}),
    ]
    for (q, v), change in refused:
        assert not fused_path(q, q, v, **{**soft, **change}), change
    monkeypatch.setattr(_gumbel, "_FUSED_AVAILABLE", False)
    assert not fused_path(_like(), _like(), _like(), **soft)


def test_cpu_tensors_take_the_existing_path():
    """On the CPU gumbel_attention keeps the SDPA path: the same seed gives gumbel_noise's sample, not the
    counter's."""
    q, k, v, padding = _inputs(torch.float32)
    assert not fused_path(q, k, v, mask=padding, hard=False, sample=True, return_weights=False)
    torch.manual_seed(3)
    out, _ = gumbel_attention(q, k, v, 0.7, mask=padding)
    torch.manual_seed(3)
    _, weights = gumbel_attention(q, k, v, 0.7, mask=padding, return_weights=True)
    torch.testing.assert_close(out, weights @ v, rtol=1e-5, atol=1e-6)


@EAGER_FLEX
def test_fused_dispatch_draws_one_seed_from_the_generator(monkeypatch):
    """With the predicate forced on the CPU (and the eager score_mod for the kernel), gumbel_attention's fused
    branch uses the seed block_seeds draws from torch's generator: seeding reproduces the dense reference."""
    monkeypatch.setattr(_gumbel, "fused_path", lambda *a, **kw: True)
    monkeypatch.setattr(_gumbel, "_compiled_fused", lambda: _fused_soft_attention)
    monkeypatch.setattr(_gumbel, "_compiled_tables", lambda: noise_tables)
    q, k, v, padding = _inputs(torch.float64)
    torch.manual_seed(5)
    seed = block_seeds(1, None)[0]
    torch.manual_seed(5)
    out, weights = _gumbel.gumbel_attention(q, k, v, 1.3, mask=padding)
    assert weights is None
    torch.testing.assert_close(out, _dense_reference(q, k, v, 1.3, seed, padding), rtol=1e-10, atol=1e-10)


# -------------------------------------------------------------------------------------------- GPU only
@cuda
@GPU_COMPILER
@INDUCTOR
@pytest.mark.parametrize("padded", [True, False])
def test_compiled_kernel_values_and_gradients_match_dense_reference(padded):
    """The compiled kernel equals the float64 dense reference with the same noise, values and gradients
    of q, k, v (float32, 1e-5 relative), lengths not a multiple of the kernel's blocks, T ≠ S."""
    q, k, v, padding = _inputs(torch.float32, "cuda", B=2, H=2, T=200, S=173, D=32, Dv=16, requires_grad=True)
    padding = padding if padded else None
    tau, seed = 0.7, _seed(2**50 + 3).cuda()
    out = _fused(_compiled_fused(), q, k, v, seed, padding, torch.tensor(1 / tau))
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _dense_reference(*leaves, tau, seed, padding)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * scale)


@cuda
@GPU_COMPILER
@INDUCTOR
def test_layer_on_cuda_runs_fused_reproducibly(monkeypatch):
    """An sto layer on CUDA with key padding takes the fused path (lengths made long): torch.manual_seed
    reproduces the sample, its gumbel_attention output is the dense reference's with the seed drawn, and the
    backward runs."""
    monkeypatch.setattr(bw, "DEVICE_BLOCK_ELEMENTS", 1)
    q, k, v, padding = _inputs(torch.float32, "cuda", B=2, H=2, T=64, S=64, D=16, Dv=16)
    assert fused_path(q, k, v, mask=padding, hard=False, sample=True, return_weights=False)
    torch.manual_seed(9)
    seed = block_seeds(1, None)[0]
    torch.manual_seed(9)
    out, _ = gumbel_attention(q, k, v, 2.0, mask=padding)
    torch.testing.assert_close(out.double(), _dense_reference(q, k, v, 2.0, seed.cuda(), padding), rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    layer = gpattn.build_attention("sto", 32, 2).cuda()
    x = torch.randn(2, 64, 32, device="cuda", requires_grad=True)
    torch.manual_seed(1)
    y = layer(x, padding)
    torch.manual_seed(1)
    assert torch.equal(y, layer(x, padding))
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@cuda
@GPU_COMPILER
@INDUCTOR
def test_compiled_kernel_memory_is_linear_in_length():
    """T = S = 16,384, one head: forward and backward add far less than the 1 GiB one (T, S) float32
    tensor would take."""
    q, k, v, _ = _inputs(torch.float32, "cuda", B=1, H=1, T=16384, S=16384, D=64, Dv=64, requires_grad=True)
    seed, inv_tau = _seed(1), torch.tensor(1.0)
    _fused(_compiled_fused(), q, k, v, seed, None, inv_tau).sum().backward()  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _fused(_compiled_fused(), q, k, v, seed, None, inv_tau).sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 64 * 2**20

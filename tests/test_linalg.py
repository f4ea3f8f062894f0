"""The numerics policy: bounded jitter escalation, clear NotPSDError, exact paths, no global changes."""

import contextlib
import subprocess
import sys
import warnings

import gpytorch
import pytest
import torch

import gpattn
from gpattn.variational import _linalg as L


def test_cholesky_plain_path_is_exact():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(3, 5, 5, generator=g, dtype=torch.float64)
    A = A @ A.mT + 5 * torch.eye(5, dtype=torch.float64)
    L.reset_stats()
    F = L.cholesky(A)
    torch.testing.assert_close(F @ F.mT, A)
    assert L.STATS == {"cholesky_calls": 1, "jitter_escalations": 0, "not_psd": 0}


def test_cholesky_escalates_jitter_on_singular_psd():
    v = torch.randn(6, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    A = v @ v.T  # rank 1: PSD, not PD
    L.reset_stats()
    with gpattn.validation():
        F = L.cholesky(A)
    assert torch.isfinite(F).all()
    assert (F @ F.T - A).abs().max() < 1e-5
    assert L.STATS["jitter_escalations"] == 1 and L.STATS["not_psd"] == 0


def test_cholesky_raises_named_error_after_bounded_tries():
    A = -torch.eye(4, dtype=torch.float64)
    L.reset_stats()
    with gpattn.validation(), pytest.raises(L.NotPSDError, match=r"4x4.*in sgpa layer 2.*jitter"):
        L.cholesky(A, name="sgpa layer 2", max_tries=2)
    assert L.STATS["not_psd"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_escalation_without_host_reads_gives_the_same_factors(dtype):
    """Validation off (the default): the branch-free ladder returns psd_safe_cholesky's factor bit for
    bit, per batch element (a PD matrix keeps its plain factor, a singular one gets the first jitter
    that works), and NaN where every try fails, instead of raising."""
    g = torch.Generator().manual_seed(2)
    v = torch.randn(3, 6, 2, dtype=dtype, generator=g)
    A = v @ v.mT  # rank 2
    A[0] += 6 * torch.eye(6, dtype=dtype)  # positive definite: no jitter
    with gpattn.validation():
        want = L.cholesky(A)
    got = L.cholesky(A)
    assert torch.equal(got, want)
    bad = L.cholesky(-torch.eye(4, dtype=dtype).expand(2, 4, 4), max_tries=2)
    assert torch.isnan(bad).all()
    assert torch.equal(L.cholesky(-torch.eye(4, dtype=dtype), max_tries=0).isnan(), torch.ones(4, 4, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_escalation_without_host_reads_has_the_same_gradient(dtype):
    """The ladder's gradient (one factorisation with gradients, of the try it chose) is psd_safe_cholesky's: the
    jitter is a constant, so the factor's gradient reaches A unchanged, for the plain and the jittered matrices (to
    round-off: the host path's written backward solves from the right, torch's from both sides)."""
    g = torch.Generator().manual_seed(3)
    v = torch.randn(3, 5, 2, dtype=dtype, generator=g)
    A0 = v @ v.mT  # rank 2: needs jitter
    A0[0] += 5 * torch.eye(5, dtype=dtype)  # positive definite: the plain factor
    weights = torch.randn(3, 5, 5, dtype=dtype, generator=g)
    grads = []
    for validating in (True, False):
        A = A0.clone().requires_grad_(True)
        with gpattn.validation(validating):
            (L.cholesky(A) * weights).sum().backward()
        grads.append(A.grad)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(grads[1], grads[0], rtol=100 * eps, atol=100 * eps * float(grads[0].abs().max()))


def test_safe_sqrt_clamps_negative_round_off():
    var = torch.tensor([-1e-9, 0.0, 4.0])
    torch.testing.assert_close(L.safe_sqrt(var), torch.tensor([0.0, 0.0, 2.0]))


def test_gp_algebra_is_exact_and_scoped():
    before = gpytorch.settings.max_cholesky_size.value()
    with L.gp_algebra():
        assert gpytorch.settings.max_cholesky_size.value() >= 10**9
        assert not gpytorch.settings.fast_computations.covar_root_decomposition.on()
        assert not gpytorch.settings.fast_computations.solves.on()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with L.gp_algebra():
                a = torch.randn(4, 4)
                assert (a @ a).dtype == torch.float32  # autocast is off inside
    assert gpytorch.settings.max_cholesky_size.value() == before


def test_exact_above_800_points():
    """A gpytorch MultivariateNormal KL at T=1000 inside gp_algebra equals the dense float64 value
    (gpytorch alone would switch to CG/Lanczos above 800 points)."""
    from gpytorch.distributions import MultivariateNormal

    T = 1000
    g = torch.Generator().manual_seed(0)
    X = torch.randn(T, 3, generator=g, dtype=torch.float64)
    K = torch.exp(-0.5 * torch.cdist(X, X) ** 2) + 1e-2 * torch.eye(T, dtype=torch.float64)
    S = 0.5 * K + 0.1 * torch.eye(T, dtype=torch.float64)
    m = torch.randn(T, generator=g, dtype=torch.float64)
    ref = torch.distributions.kl_divergence(
        torch.distributions.MultivariateNormal(m, S),
        torch.distributions.MultivariateNormal(torch.zeros(T, dtype=torch.float64), K),
    )
    with L.gp_algebra():
        ours = torch.distributions.kl_divergence(MultivariateNormal(m, S), MultivariateNormal(torch.zeros_like(m), K))
    assert abs(float(ours) - float(ref)) < 1e-6 * abs(float(ref))


def test_import_changes_no_global_setting():
    code = (
        "import torch, gpytorch, linear_operator, matplotlib\n"
        "before = (gpytorch.settings.max_cholesky_size.value(), gpytorch.settings.fast_computations.solves.on(),"
        " linear_operator.settings.cholesky_jitter.value(torch.float32), matplotlib.get_backend())\n"
        "import gpattn, gpattn.models\n"
        "import gpattn.experiments.training, gpattn.experiments.metrics\n"
        "import gpattn.experiments.plots, gpattn.experiments.data\n"
        "gpattn.list_attention()\n"
        "after = (gpytorch.settings.max_cholesky_size.value(), gpytorch.settings.fast_computations.solves.on(),"
        " linear_operator.settings.cholesky_jitter.value(torch.float32), matplotlib.get_backend())\n"
        "assert before == after, (before, after)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_add_jitter_float_and_per_batch_tensor():
    A = torch.zeros(2, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(L.add_jitter(A, 0.5), 0.5 * torch.eye(3, dtype=torch.float64).expand(2, 3, 3))
    per = L.add_jitter(A, torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(
        torch.diagonal(per, dim1=-2, dim2=-1), torch.tensor([[1.0] * 3, [2.0] * 3], dtype=torch.float64)
    )
    assert L.add_jitter(A, 0) is A


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_host_fast_path_is_the_ladder_bit_for_bit(dtype):
    """A CPU batch that factorises without jitter skips the ladder: the same factor, bit for bit, and the same
    gradient to round-off (the host path's written backward, :func:`gpattn.variational._linalg.cholesky_backward`)."""
    g = torch.Generator().manual_seed(4)
    v = torch.randn(3, 6, 8, dtype=dtype, generator=g)
    A0 = v @ v.mT + 1e-2 * torch.eye(6, dtype=dtype)
    weights = torch.randn(3, 6, 6, dtype=dtype, generator=g)
    factors, grads = [], []
    def ladder(A):  # what cholesky returned before the host path: the ladder's factor, NaN where it failed
        F, info = L._ladder(A, 4)
        return F.masked_fill((info > 0)[..., None, None], torch.nan)

    for fn in (L.cholesky, ladder):
        A = A0.clone().requires_grad_(True)
        F = fn(A)
        (F * weights).sum().backward()
        factors.append(F.detach())
        grads.append(A.grad)
    assert torch.equal(factors[0], factors[1])
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(grads[0], grads[1], rtol=100 * eps, atol=100 * eps * float(grads[1].abs().max()))
    assert factors[0].stride() == factors[1].stride()  # the layout too: products round by it


@contextlib.contextmanager
def _tracing_quietly():
    """What Dynamo warns about while it traces (as in tests/test_compile.py)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        warnings.filterwarnings("ignore", message=".*should not be instantiated", category=DeprecationWarning)
        yield


def _weighted_factor(fn, A0, weights):
    A = A0.clone().requires_grad_(True)
    F = fn(A)
    (F * weights).sum().backward()
    return F.detach(), A.grad


def test_compiled_host_path_factorises_once_and_escalates_only_a_failing_batch():
    """Under torch.compile a CPU batch takes the host shortcut as one operator in the graph: a batch that factorises
    gets the plain factor, one that needs jitter the ladder's, and the written-out backward is PyTorch's own
    Cholesky backward to float64 round-off — checked for both branches, against eager."""
    import torch._dynamo as dynamo

    g = torch.Generator().manual_seed(5)
    v = torch.randn(3, 6, 8, dtype=torch.float64, generator=g)
    weights = torch.randn(3, 6, 6, dtype=torch.float64, generator=g)
    ok = v @ v.mT + 1e-2 * torch.eye(6, dtype=torch.float64)
    w = torch.randn(3, 6, 2, dtype=torch.float64, generator=g)
    low_rank = w @ w.mT  # rank 2: the plain factorisation fails, the ladder's first jitter succeeds
    dynamo.reset()
    compiled = torch.compile(L.cholesky, backend="aot_eager", fullgraph=True)
    with _tracing_quietly():
        for A0 in (ok, low_rank):
            F_eager, g_eager = _weighted_factor(L.cholesky, A0, weights)
            F_comp, g_comp = _weighted_factor(compiled, A0, weights)
            assert torch.isfinite(F_comp).all()
            torch.testing.assert_close(F_comp, F_eager, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(g_comp, g_eager, rtol=1e-9, atol=1e-9)
        assert not torch.isfinite(compiled(-torch.eye(4, dtype=torch.float64))).any()  # every try fails: NaN
    dynamo.reset()


def test_written_out_cholesky_backward_is_the_gradient():
    """The host operator's written-out backward against finite differences (float64 gradcheck)."""
    g = torch.Generator().manual_seed(6)
    v = torch.randn(2, 5, 7, dtype=torch.float64, generator=g)
    A = (v @ v.mT + 0.1 * torch.eye(5, dtype=torch.float64)).requires_grad_(True)

    def factor(X):
        X = 0.5 * (X + X.mT)  # finite differences perturb one entry; the factorisation reads a symmetric matrix
        return L._host_cholesky(X, 4)

    assert torch.autograd.gradcheck(factor, (A,))


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize(
    "shapes",
    [
        ((1, 3, 5, 5), (4, 3, 5, 2)),  # a per-head factor against a batch of sequences
        ((2, 1, 3, 5, 5), (2, 4, 3, 5, 5)),  # scgp's stacked pair: the shared axis in the middle
        ((1, 1, 5, 5), (3, 2, 5, 1)),  # two shared axes
        ((3, 1, 5, 5), (1, 2, 5, 3)),  # each has a broadcast axis: only the factor's is folded
    ],
)
def test_tri_solve_with_a_shared_factor_is_the_broadcast_solve(shapes, upper):
    """A factor of size 1 along batch axes of the right-hand side solves those axes as columns side by side: the
    values and both gradients of the broadcast solve (float64, to round-off), for lower and upper factors."""
    (ls, bs), gen = shapes, torch.Generator().manual_seed(3)
    A = torch.randn(*ls, dtype=torch.float64, generator=gen)
    factor = torch.linalg.cholesky(A @ A.mT + ls[-1] * torch.eye(ls[-1], dtype=torch.float64))
    factor = factor.mT if upper else factor
    rhs = torch.randn(*bs, dtype=torch.float64, generator=gen)
    weight = torch.randn(torch.broadcast_shapes(ls[:-2], bs[:-2]) + bs[-2:], dtype=torch.float64, generator=gen)
    grads = []
    for solve in (L.tri_solve, torch.linalg.solve_triangular):
        f, b = factor.clone().requires_grad_(), rhs.clone().requires_grad_()
        out = solve(f, b, upper=upper)
        (out * weight).sum().backward()
        grads.append((out.detach(), f.grad, b.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert L._shared_axes(factor, rhs), "the case should take the folded path"

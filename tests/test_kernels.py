"""ExponentialKernel against its formula and gpytorch's kernel test case; kernel specs (names,
compositions, the stream-scale start, serialisation through training) and the build-time checks."""

import json
import unittest

import pytest
import torch
from gpytorch.kernels import AdditiveKernel, MaternKernel, ProductKernel, RBFKernel, ScaleKernel
from gpytorch.test.base_kernel_test_case import BaseKernelTestCase

import gpattn
from gpattn._migrate import migrate_config
from gpattn.experiments.cli import _kv
from gpattn.experiments.cli import main as cli_main
from gpattn.experiments.training import TrainConfig, load_run_with_data, predict, train
from gpattn.kernels import (
    CanonicalRBFKernel,
    ExponentialKernel,
    check_kernel,
    evaluate_kernel,
    kernel_spec,
    make_kernel,
)


def test_exponential_kernel_matches_formula_per_head():
    torch.manual_seed(0)
    H, d = 3, 4
    k = ExponentialKernel(ard_num_dims=d, batch_shape=torch.Size([H])).double()
    k.lengthscale = torch.rand(H, 1, d, dtype=torch.float64) + 0.5
    k.outputscale = torch.rand(H, dtype=torch.float64) + 0.5
    a = torch.randn(2, H, 5, d, dtype=torch.float64)
    b = torch.randn(2, H, 6, d, dtype=torch.float64)
    K = evaluate_kernel(k, a, b)
    ell, s2 = k.lengthscale.detach(), k.outputscale.detach()
    for h in range(H):
        for i in range(5):
            for j in range(6):
                ref = s2[h] * torch.exp((a[1, h, i] * b[1, h, j] / ell[h, 0] ** 2).sum())
                torch.testing.assert_close(K[1, h, i, j], ref)
    torch.testing.assert_close(
        evaluate_kernel(k, a, a, diag=True), torch.diagonal(evaluate_kernel(k, a, a), dim1=-2, dim2=-1)
    )


def test_exponential_kernel_is_psd_and_scaled_like_softmax():
    torch.manual_seed(1)
    k = ExponentialKernel(ard_num_dims=16, batch_shape=torch.Size([2])).double()
    torch.testing.assert_close(k.lengthscale, torch.full((2, 1, 16), 16**0.25, dtype=torch.float64))
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    K = evaluate_kernel(k, x, x)
    torch.testing.assert_close(K, K.mT)
    assert torch.linalg.eigvalsh(K).min() > -1e-8 * K.abs().max()
    # the outputscale 1 is initialised through a float32 softplus: 1e-6 relative
    torch.testing.assert_close(K, torch.exp(x @ x.mT / 16**0.5), rtol=1e-6, atol=0)


def test_exponential_kernel_gradients():
    k = ExponentialKernel(ard_num_dims=3, batch_shape=torch.Size([2])).double()
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x: evaluate_kernel(k, x, x), (x,))
    evaluate_kernel(k, x, x).sum().backward()
    assert k.raw_lengthscale.grad is not None and k.raw_outputscale.grad is not None


def test_factory():
    assert isinstance(make_kernel("exponential", 2, 4), ExponentialKernel)
    for rbf in (make_kernel("ard-rbf", 2, 4), make_kernel({"name": "ard-rbf"}, 2, 4)):
        assert isinstance(rbf, ScaleKernel) and isinstance(rbf.base_kernel, RBFKernel)
        assert rbf.base_kernel.lengthscale.shape == (2, 1, 4)
    mine = MaternKernel()
    assert make_kernel(mine, 2, 4) is mine
    with pytest.raises(ValueError, match="unknown kernel name 'laplace'; valid: ard-rbf, canonical-rbf, exponential"):
        make_kernel("laplace", 2, 4)


@pytest.mark.parametrize(
    "kernel",
    [
        ExponentialKernel(ard_num_dims=3, batch_shape=torch.Size([2])),
        ScaleKernel(RBFKernel(ard_num_dims=3, batch_shape=torch.Size([2])), batch_shape=torch.Size([2])),
        MaternKernel(nu=1.5),
        RBFKernel(active_dims=torch.tensor([0, 2])),
        make_kernel({"name": "sum", "kernels": ["ard-rbf", "matern"]}, 2, 3),
        make_kernel({"name": "product", "kernels": ["ard-rbf", "exponential", "matern"]}, 2, 3),
        make_kernel({"name": "scale", "base": "ard-rbf", "outputscale": 0.5}, 2, 3),
    ],
    ids=["exponential", "scale-rbf", "matern", "rbf-active-dims", "sum", "product", "scale-of-scale-rbf"],
)
def test_evaluate_kernel_equals_gpytorch_call(kernel):
    x1 = torch.randn(4, 2, 5, 3)
    x2 = torch.randn(4, 2, 6, 3)
    torch.testing.assert_close(evaluate_kernel(kernel, x1, x2), kernel(x1, x2).to_dense())
    torch.testing.assert_close(evaluate_kernel(kernel, x1, x1, diag=True), kernel(x1, x1, diag=True))


def test_exponential_kernel_without_batch_shape():
    k = ExponentialKernel(ard_num_dims=2)
    x = torch.randn(5, 2)
    torch.testing.assert_close(evaluate_kernel(k, x, x), torch.exp(x @ x.T / 2**0.5))


class TestExponentialKernelIsAGPyTorchKernel(BaseKernelTestCase, unittest.TestCase):
    """gpytorch's own kernel test case (batch shapes, ARD, active_dims, indexing, pickling, dtype)."""

    seed = 0

    def create_kernel_no_ard(self, **kwargs):
        kern = ExponentialKernel(**kwargs)
        kern.lengthscale = 3.0  # exponents of O(1) on the test case's N(0, 1) data
        return kern

    def create_kernel_ard(self, num_dims, **kwargs):
        return ExponentialKernel(ard_num_dims=num_dims, **kwargs)


# ------------------------------------------------------------------------------------------ specs
H, DH = 2, 4
#: a composition of every kind: Σ [exponential, canonical-rbf · 0.5 matern-1.5]
COMPOSED = {
    "name": "sum",
    "kernels": [
        {"name": "exponential", "lengthscale": 3.0},
        {
            "name": "product",
            "kernels": ["canonical-rbf", {"name": "scale", "base": {"name": "matern", "nu": 1.5}, "outputscale": 0.5}],
        },
    ],
}


def _points(seed=0, n=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, H, n, DH, generator=g, dtype=torch.float64) / 2  # shape: (B, H, T, Dh)


def test_rbf_names_are_distinct_and_the_old_name_is_an_error_a_saved_config_migrates():
    x = _points()
    ard = make_kernel("ard-rbf", H, DH).double()
    canonical = make_kernel("canonical-rbf", H, DH).double()
    assert isinstance(ard, ScaleKernel) and isinstance(ard.base_kernel, RBFKernel)
    assert isinstance(canonical, CanonicalRBFKernel) and canonical.batch_shape == (H,)
    assert not torch.allclose(evaluate_kernel(ard, x, x), evaluate_kernel(canonical, x, x))
    for name in ("sgpa", "cgp"):
        with pytest.raises(ValueError, match="'rbf' names two kernels; use 'ard-rbf' .* or 'canonical-rbf'"):
            gpattn.build_attention(name, H * DH, H, kernel="rbf")
    # a config an older gpattn saved: "rbf" keeps the one meaning it had for each variant, nested specs too
    meant = {"sgpa": "ard-rbf", "sgpa-decoupled": "ard-rbf", "kernel": "ard-rbf", "kernel-asym": "ard-rbf",
             "cgp": "canonical-rbf", "scgp": "canonical-rbf"}
    for name, new in meant.items():
        old = {"attention": name, "attention_options": {"kernel": {"name": "sum", "kernels": ["rbf", "rbf"]}}}
        with pytest.warns(gpattn.OldVersionWarning, match="kernel=.*'rbf' split into"):
            d = migrate_config(old)
        assert d["attention_options"]["kernel"] == {"name": "sum", "kernels": [new, new]}, name
        assert old["attention_options"]["kernel"]["kernels"] == ["rbf", "rbf"]  # the saved dict is not changed
        with pytest.warns(gpattn.OldVersionWarning):
            assert migrate_config({**old, "attention_options": {"kernel": "rbf"}})["attention_options"]["kernel"] == new
    with pytest.warns(gpattn.OldVersionWarning):
        options = migrate_config({"attention": "sgpa", "attention_options": {"kernel": "rbf"}})["attention_options"]
    kern = gpattn.build_attention("sgpa", H * DH, H, **options).kernel
    assert isinstance(kern, ScaleKernel) and isinstance(kern.base_kernel, RBFKernel)
    assert type(gpattn.build_attention("cgp", H * DH, H).strategy.covar.canonical) is CanonicalRBFKernel


def test_a_composed_spec_is_the_sum_product_and_scale_of_its_parts():
    kern = make_kernel(COMPOSED, H, DH).double()
    assert isinstance(kern, AdditiveKernel) and isinstance(kern.kernels[1], ProductKernel)
    assert kern.batch_shape == (H,)
    a, b = _points(1), _points(2, n=6)
    # references from the formulas (docs/derivations.md "Kernels"; Matérn-3/2 with ℓ = √Dh)
    expo = torch.exp(a @ b.mT / 9.0)  # σ² = 1 (no prior variance), ℓ = 3
    dist2 = (a[..., :, None, :] - b[..., None, :, :]).pow(2).sum(-1)
    r = dist2.clamp_min(1e-30).sqrt() * 3**0.5 / DH**0.5
    ref = expo + torch.exp(-0.5 * dist2) * 0.5 * (1 + r) * torch.exp(-r)
    torch.testing.assert_close(evaluate_kernel(kern, a, b), ref)
    torch.testing.assert_close(kern(a, b).to_dense(), ref)


@pytest.mark.parametrize(
    "spec",
    [
        "ard-rbf",
        {"name": "scale", "base": "matern"},
        {"name": "sum", "kernels": ["ard-rbf", {"name": "scale", "base": "canonical-rbf"}, "ard-rbf"]},
        {"name": "product", "kernels": ["canonical-rbf", "ard-rbf", "ard-rbf"]},
        {"name": "product", "kernels": ["matern", {"name": "sum", "kernels": ["ard-rbf", "ard-rbf"]}]},
    ],
    ids=["ard-rbf", "scale", "sum", "product", "product-of-sum"],
)
def test_specs_start_at_the_stream_prior_variance(spec):
    """κ(x, x) = prior_variance for every stationary spec (gpattn.variational._scale), whatever the
    composition: a sum splits it, a product puts it in one factor, a scale node holds it."""
    kern = make_kernel(spec, H, DH, prior_variance=0.01).double()
    x = _points(3)
    torch.testing.assert_close(evaluate_kernel(kern, x, x, diag=True), torch.full((3, H, 5), 0.01, dtype=torch.float64))


def test_stream_scale_of_the_exponential_kernel_and_explicit_options():
    kern = make_kernel("exponential", H, DH, prior_variance=0.01)
    torch.testing.assert_close(kern.lengthscale, torch.full((H, 1, DH), DH**0.5))  # ℓ = √Dh
    torch.testing.assert_close(kern.outputscale, torch.full((H,), 0.01))
    torch.testing.assert_close(make_kernel("exponential", H, DH).lengthscale, torch.full((H, 1, DH), DH**0.25))
    given = make_kernel({"name": "ard-rbf", "lengthscale": 2.5, "outputscale": 0.5}, H, DH, prior_variance=0.01)
    torch.testing.assert_close(given.outputscale, torch.full((H,), 0.5))
    torch.testing.assert_close(given.base_kernel.lengthscale, torch.full((H, 1, DH), 2.5))


@pytest.mark.parametrize(
    "spec, message",
    [
        (3, r"kernel must be a kernel name \(ard-rbf, canonical-rbf, exponential, matern\)"),
        (
            {"name": "sum", "kernels": ["exponential", "laplace"]},
            r"kernel\['kernels'\]\[1\]: unknown kernel name 'laplace'",
        ),
        (
            {"name": "ard-rbf", "period": 2.0},
            r"unknown option\(s\) \['period'\] for kernel 'ard-rbf'; valid: lengthscale",
        ),
        (
            {"name": "scale", "base": {"name": "exponential", "lengthscale": -1}},
            r"kernel\['base'\]\['lengthscale'\] must",
        ),
        ({"name": "matern", "nu": 2}, r"kernel\['nu'\] must be one of \[0.5, 1.5, 2.5\], got 2"),
        ({"name": "scale"}, r"kernel 'scale' needs 'base'"),
        ({"name": "product", "kernels": ["exponential"]}, r"kernel\['kernels'\] must be a list of at least two"),
        ({"name": "sum", "kernels": ["rbf", "exponential"]}, r"kernel\['kernels'\]\[0\]: 'rbf' names two kernels"),
    ],
)
def test_spec_errors_name_the_place(spec, message):
    with pytest.raises(ValueError, match=message):
        make_kernel(spec, H, DH)


def test_a_bad_spec_fails_when_the_layer_is_built():
    with pytest.raises(ValueError, match=r"kernel\['kernels'\]\[1\]: unknown kernel name 'laplace'"):
        gpattn.build_attention("sgpa", H * DH, H, kernel={"name": "sum", "kernels": ["exponential", "laplace"]})


@pytest.mark.parametrize("spec", ["exponential", {"name": "ard-rbf", "lengthscale": 2.5}, COMPOSED])
def test_kernel_spec_describes_a_built_kernel(spec):
    kern = make_kernel(spec, H, DH, prior_variance=0.01)
    described = kernel_spec(kern)
    again = make_kernel(json.loads(json.dumps(described)), H, DH)  # plain JSON, without the start values
    assert again.state_dict().keys() == kern.state_dict().keys()
    for key, value in kern.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], value, rtol=1e-5, atol=1e-6)


def test_kernel_spec_refuses_what_no_spec_builds():
    with pytest.raises(ValueError, match="RBFKernel has no kernel spec; specs build ard-rbf, canonical-rbf"):
        kernel_spec(RBFKernel())
    with pytest.raises(ValueError, match="active_dims"):
        kernel_spec(ScaleKernel(RBFKernel(active_dims=[0, 1])))


# ------------------------------------------------------------------ build-time checks of instances
D_WIDE, H4 = 16, 4  # Dh = 4


@pytest.mark.parametrize("name", ["sgpa", "sgpa-decoupled", "kernel", "kernel-asym", "cgp", "scgp"])
def test_a_kernel_on_embed_dim_is_refused_at_construction(name):
    bad = ScaleKernel(RBFKernel(ard_num_dims=D_WIDE, batch_shape=torch.Size([H4])), batch_shape=torch.Size([H4]))
    with pytest.raises(ValueError, match=r"kernel: RBFKernel has ard_num_dims=16, .* of width 4 .* ard_num_dims=4"):
        gpattn.build_attention(name, D_WIDE, H4, kernel=bad)
    with pytest.raises(ValueError, match=r"kernel: batch_shape \(3,\) does not broadcast .* num_heads = 4; use batch_"):
        gpattn.build_attention(name, D_WIDE, H4, kernel=MaternKernel(batch_shape=torch.Size([3])))


@pytest.mark.parametrize(
    "kernel",
    [
        RBFKernel(ard_num_dims=4, batch_shape=torch.Size([4])),
        MaternKernel(batch_shape=torch.Size([1, 4])),
        ScaleKernel(RBFKernel(ard_num_dims=2, active_dims=[0, 3])),
        AdditiveKernel(ExponentialKernel(ard_num_dims=4), RBFKernel()),
    ],
    ids=["per-head-ard", "(1, H)", "active-dims", "sum"],
)
def test_kernels_that_fit_the_head_width_pass(kernel):
    check_kernel(kernel, H4, 4)
    layer = gpattn.build_attention("sgpa", D_WIDE, H4, kernel=kernel)
    assert layer(torch.randn(2, 3, D_WIDE)).shape == (2, 3, D_WIDE)


def test_width_errors_inside_compositions_and_active_dims():
    inner = AdditiveKernel(ExponentialKernel(ard_num_dims=4), ScaleKernel(MaternKernel(ard_num_dims=16)))
    with pytest.raises(ValueError, match="MaternKernel has ard_num_dims=16"):
        check_kernel(inner, H4, 4)
    with pytest.raises(ValueError, match=r"active_dims=\[0, 5\], but its inputs have 4 dimensions"):
        check_kernel(RBFKernel(active_dims=[0, 5]), H4, 4)


def test_kep_svgp_takes_only_the_cosine_kernel():
    assert gpattn.attention_options("kep-svgp")["kernel"] == "cosine"
    for kernel in ("cosine", {"name": "cosine"}):
        gpattn.build_attention("kep-svgp", 8, 2, kernel=kernel)
    for kernel in ("exponential", {"name": "ard-rbf"}, COMPOSED, RBFKernel()):
        with pytest.raises(ValueError, match=r"kep-svgp takes only kernel='cosine' .* solved in the primal"):
            gpattn.build_attention("kep-svgp", 8, 2, kernel=kernel)


# ------------------------------------------------------------------ serialisation through training
def test_train_config_refuses_a_kernel_instance_and_shows_its_spec():
    kern = AdditiveKernel(ExponentialKernel(ard_num_dims=4), ScaleKernel(MaternKernel(nu=1.5, ard_num_dims=4)))
    with pytest.raises(ValueError, match=r"attention_options\['kernel'\] is a gpytorch kernel instance") as err:
        TrainConfig(attention="sgpa", attention_options={"kernel": kern})
    hint = "{'name': 'sum', 'kernels': [{'name': 'exponential', 'lengthscale': 1.41421, 'outputscale': 1.0}, "
    assert f"pass its spec instead: {hint}" in str(err.value)
    with pytest.raises(ValueError, match="it has no spec"):
        TrainConfig(attention="sgpa", attention_options={"kernel": RBFKernel()})
    cfg = TrainConfig(attention="sgpa", attention_options={"kernel": COMPOSED})
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_the_cli_reads_a_kernel_spec():
    assert _kv(f"kernel={COMPOSED!r}") == ("kernel", COMPOSED)
    assert _kv("kernel=ard-rbf") == ("kernel", "ard-rbf")


@pytest.mark.slow  # three tiny trainings, ~8 s on one thread
def test_a_composed_kernel_trains_checkpoints_resumes_and_reloads(tmp_path):
    """CLI → config.json → an interrupted and resumed run → load_run: the same spec and the same
    predictions as the uninterrupted run."""
    spec = {"name": "sum", "kernels": ["exponential", {"name": "scale", "base": {"name": "matern", "nu": 1.5}}]}
    full, cut = tmp_path / "full", tmp_path / "cut"
    args = ["train", "--dataset", "digits", "--dataset-option", "severities=[1]", "--batch-size", "64",
            "--embed-dim", "8", "--num-heads", "2", "--num-layers", "1", "--num-samples", "2", "--epochs", "1",
            "--checkpoint-every", "2", "--no-progress", "--attention", "sgpa"]  # fmt: skip
    assert cli_main([*args, "--attention-option", f"kernel={spec!r}", "--out", str(full)]) == 0
    saved = json.loads((full / "config.json").read_text())
    assert saved["attention_options"] == {"kernel": spec}
    cfg = TrainConfig.from_dict(saved)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, cut, stop_after_steps=3)
    train(cfg, cut, resume=True)
    assert json.loads((full / "metrics.json").read_text()) == json.loads((cut / "metrics.json").read_text())
    ours, theirs = (torch.load(f / "predictions.pt", weights_only=True) for f in (full, cut))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    reloaded = []
    for folder in (full, cut):
        _, model, bundle, _ = load_run_with_data(folder)
        kern = model.encoder.blocks[0].attn.kernel
        assert isinstance(kern, AdditiveKernel) and kernel_spec(kern)["name"] == "sum"
        torch.manual_seed(0)
        reloaded.append(predict(model, bundle.splits["test"], num_samples=2))
    torch.testing.assert_close(reloaded[0], reloaded[1], rtol=0, atol=0)


def test_correlated_gps_take_stationary_specs_only():
    for spec in (
        "ard-rbf",
        "matern",
        {"name": "product", "kernels": ["canonical-rbf", {"name": "scale", "base": "matern"}]},
    ):
        layer = gpattn.build_attention("scgp", 8, 2, kernel=spec)
        assert torch.isfinite(layer(torch.randn(2, 5, 8))).all()
    with pytest.raises(ValueError, match=r"kernel\['kernels'\]\[1\]: kernel 'exponential' is not stationary"):
        gpattn.build_attention("cgp", 8, 2, kernel={"name": "sum", "kernels": ["ard-rbf", "exponential"]})


@pytest.mark.parametrize("scaled", [False, True])
def test_rbf_is_evaluated_without_gpytorchs_host_read(monkeypatch, scaled):
    """evaluate_kernel gives gpytorch's (ARD) RBF values and gradients, blocks and diagonals, without
    covar_dist's torch.equal (a host read per forward, a torch.compile graph break)."""
    from gpytorch.kernels import RBFKernel, ScaleKernel
    from linear_operator import to_dense

    from gpattn.kernels import evaluate_kernel

    torch.manual_seed(0)
    k = RBFKernel(ard_num_dims=4, batch_shape=torch.Size([3]))
    if scaled:
        k = ScaleKernel(k, batch_shape=torch.Size([3]))
        k.outputscale = torch.rand(3) + 0.3
    k = k.double()
    (k.base_kernel if scaled else k).lengthscale = torch.rand(3, 1, 4, dtype=torch.float64) + 0.5
    a = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 3, 6, 4, dtype=torch.float64)
    refs = [to_dense(k.forward(a, b)), to_dense(k.forward(a, a, diag=True))]
    grads = torch.autograd.grad(sum(r.sum() for r in refs), a)
    monkeypatch.setattr(torch, "equal", lambda *args: (_ for _ in ()).throw(AssertionError("torch.equal called")))
    outs = [evaluate_kernel(k, a, b), evaluate_kernel(k, a, a, diag=True)]
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(sum(o.sum() for o in outs), a)[0], grads[0], rtol=1e-10, atol=1e-12)

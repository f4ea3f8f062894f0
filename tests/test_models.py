"""Classifiers: shapes, the sample axis, deep-GP propagation, padding, attention_layers, errors."""

import pytest
import torch

import gpattn
from gpattn.models import Encoder, TransformerClassifier, ViTClassifier, resolve_attention_layers


def _ids(B=3, T=7, V=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 5:] = True
    ids[mask] = 0
    return ids, mask


def test_transformer_logits_have_sample_axis():
    torch.manual_seed(0)
    model = TransformerClassifier(3, vocab_size=30, embed_dim=16, num_heads=2)
    ids, mask = _ids()
    assert model(ids, mask).shape == (3, 1, 3)
    assert model(ids, mask, num_samples=5).shape == (3, 5, 3)


def test_samples_differ_for_stochastic_attention_and_not_for_softmax():
    torch.manual_seed(0)
    ids, mask = _ids()
    det = TransformerClassifier(2, vocab_size=30, embed_dim=16, num_heads=2, dropout=0.0).eval()
    out = det(ids, mask, num_samples=4)
    torch.testing.assert_close(out, out[:, :1].expand_as(out))
    # a stochastic callable attention: each of the B·P rows gets its own noise
    noisy = TransformerClassifier(
        2, vocab_size=30, embed_dim=16, num_heads=2, dropout=0.0, attention=_NoisyAttention
    ).eval()
    out = noisy(ids, mask, num_samples=4)
    assert (out[:, 1:] - out[:, :1]).abs().max() > 1e-3
    with gpattn.deterministic():
        out = noisy(ids, mask, num_samples=4)
    torch.testing.assert_close(out, out[:, :1].expand_as(out))


class _NoisyAttention(torch.nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.lin = torch.nn.Linear(embed_dim, embed_dim)

    def forward(self, x, mask=None):
        noise = 0 if gpattn.is_deterministic() else torch.randn(x.shape[0], 1, x.shape[2])
        return self.lin(x) + noise

    def loss_terms(self):
        return {"kl_global": self.lin.weight.sum() * 0}


def test_sample_rows_are_b_major():
    """Sample p of sequence b belongs to sequence b: with P samples, sequence b's logits equal the
    deterministic model's for b (the sample axis never mixes sequences)."""
    torch.manual_seed(0)
    model = TransformerClassifier(2, vocab_size=30, embed_dim=16, num_heads=2, dropout=0.0).eval()
    ids, mask = _ids(B=4)
    one = model(ids, mask, num_samples=1)
    many = model(ids, mask, num_samples=3)
    for p in range(3):
        torch.testing.assert_close(many[:, p], one[:, 0])


def test_mean_pooling_ignores_padding():
    torch.manual_seed(0)
    model = TransformerClassifier(2, vocab_size=30, embed_dim=16, num_heads=2, dropout=0.0).eval()
    ids, mask = _ids()
    a = model(ids, mask)
    ids2 = ids.clone()
    ids2[mask] = 7  # different ids at padded positions
    torch.testing.assert_close(model(ids2, mask), a)
    # and equals the model run on the truncated sequence alone
    torch.testing.assert_close(model(ids[:1, :5], None)[0], a[0])


def test_dense_features_and_cls_pooling():
    torch.manual_seed(0)
    model = TransformerClassifier(4, input_dim=6, embed_dim=16, num_heads=4, pooling="cls", max_len=9)
    assert model(torch.randn(2, 9, 6), num_samples=2).shape == (2, 2, 4)
    with pytest.raises(ValueError, match="at most 9"):
        model(torch.randn(2, 10, 6))


def test_vit_patches():
    torch.manual_seed(0)
    model = ViTClassifier(5, image_shape=(1, 8, 8), patch_size=2, embed_dim=16, num_heads=2)
    assert model(torch.rand(3, 1, 8, 8), num_samples=2).shape == (3, 2, 5)
    with pytest.raises(ValueError, match=r"\(B, \*\(1, 8, 8\)\)"):
        model(torch.rand(3, 1, 7, 8))
    with pytest.raises(ValueError, match="divisible"):
        ViTClassifier(5, image_shape=(1, 8, 8), patch_size=3)


def test_attention_layers_choice():
    enc = Encoder(16, 2, 3, attention="kernel", attention_layers="last")
    assert [m.name for m in enc.attention_modules()] == ["softmax", "softmax", "kernel"]
    enc = Encoder(16, 2, 3, attention="kernel", attention_layers=[0, -1])
    assert [m.name for m in enc.attention_modules()] == ["kernel", "softmax", "kernel"]
    assert resolve_attention_layers("all", 2) == [0, 1]
    with pytest.raises(ValueError, match="attention_layers"):
        resolve_attention_layers([5], 3)
    with pytest.raises(ValueError, match="attention_layers"):
        resolve_attention_layers("first", 3)


def test_kernel_instances_are_copied_per_layer():
    from gpytorch.kernels import RBFKernel

    k = RBFKernel(batch_shape=torch.Size([2]))
    enc = Encoder(16, 2, 2, attention="kernel", attention_options={"kernel": k})
    kernels = [m.kernel for m in enc.attention_modules()]
    assert kernels[0] is not kernels[1] and kernels[0] is not k


@pytest.mark.parametrize("name", gpattn.list_attention())
def test_image_models_use_the_seeds_image_kernel(name):
    # Bui et al. §5.1: SGPA and kernel attention use ARD-RBF on images, the exponential kernel on text
    from gpytorch.kernels import RBFKernel, ScaleKernel

    from gpattn.kernels import ExponentialKernel

    def kernels(model):
        return [m.kernel for m in model.encoder.attention_modules() if m.name == name and hasattr(m, "kernel")]

    vit = ViTClassifier(3, image_shape=(1, 4, 4), embed_dim=8, num_heads=2, attention=name)
    text = TransformerClassifier(3, vocab_size=10, embed_dim=8, num_heads=2, attention=name)
    if gpattn.attention_options(name).get("kernel") != "exponential":  # cgp/scgp: canonical RBF everywhere
        assert [type(k) for k in kernels(vit)] == [type(k) for k in kernels(text)]
        return
    assert kernels(vit)
    assert all(isinstance(k, ScaleKernel) and isinstance(k.base_kernel, RBFKernel) for k in kernels(vit))
    assert all(isinstance(k, ExponentialKernel) for k in kernels(text))
    chosen = ViTClassifier(3, image_shape=(1, 4, 4), embed_dim=8, num_heads=2, attention=name,
                           attention_options={"kernel": "exponential"})
    assert all(isinstance(k, ExponentialKernel) for k in kernels(chosen))  # the caller's kernel wins


def test_loss_terms_are_summed_over_layers():
    torch.manual_seed(0)
    model = TransformerClassifier(2, vocab_size=30, embed_dim=16, num_heads=2, attention=_NoisyAttention)
    ids, mask = _ids()
    model(ids, mask)
    layers = model.encoder.attention_modules()
    expected = sum(layer.loss_terms()["kl_global"] for layer in layers)
    torch.testing.assert_close(model.loss_terms()["kl_global"], expected)


def test_input_errors():
    model = TransformerClassifier(2, vocab_size=30, embed_dim=16, num_heads=2)
    ids, mask = _ids()
    with pytest.raises(ValueError, match="token ids"):
        model(ids.float(), mask)
    with gpattn.validation(), pytest.raises(ValueError, match="vocab_size"):  # a value check: opt-in
        model(ids + 100, mask)
    with pytest.raises(ValueError, match="key_padding_mask"):
        model(ids, mask[:, :3])
    with pytest.raises(ValueError, match="num_samples"):
        model(ids, mask, num_samples=0)
    with pytest.raises(ValueError, match="exactly one"):
        TransformerClassifier(2)
    with pytest.raises(ValueError, match="unknown option"):
        TransformerClassifier(2, vocab_size=5, attention_options={"nope": 1})


def test_mc_dropout_samples_in_eval_mode():
    torch.manual_seed(0)
    ids, mask = _ids()
    model = TransformerClassifier(2, vocab_size=30, embed_dim=16, num_heads=2, dropout=0.3, mc_dropout=True).eval()
    out = model(ids, mask, num_samples=4)
    assert (out[:, 1:] - out[:, :1]).abs().max() > 1e-4
    with gpattn.deterministic():
        out = model(ids, mask, num_samples=4)
    torch.testing.assert_close(out, out[:, :1].expand_as(out))


def _rows_per_block(model):
    """The leading axes, (B,) or (P, B), of the stream that entered each encoder block in the model's last forward."""
    seen = []
    for i, block in enumerate(model.encoder.blocks):
        block.register_forward_pre_hook(lambda mod, args, i=i: seen.append((i, tuple(args[0].shape[:-2]))))
    return seen


def test_deterministic_blocks_run_once_per_input():
    """An explicit sample axis: a softmax model in eval mode runs once per input (P equal draws); in a
    last-layer GP model the softmax block below runs on B rows and the GP block *also* receives B
    rows — it factorises once and draws P samples, so only the blocks after it see the (P, B, T, D) stream; with
    training-mode dropout the embedding dropout samples, so every block sees it."""
    torch.manual_seed(0)
    ids, mask = _ids(B=3)
    det = TransformerClassifier(2, vocab_size=30, embed_dim=16, num_heads=2, num_layers=2).eval()
    det_seen = _rows_per_block(det)
    out = det(ids, mask, num_samples=5)
    assert det_seen == [(0, (3,)), (1, (3,))] and out.shape == (3, 5, 2)
    torch.testing.assert_close(out, det(ids, mask, num_samples=1).expand_as(out))
    gp = TransformerClassifier(
        2, vocab_size=30, embed_dim=16, num_heads=2, num_layers=2, attention="sgpa", attention_layers="last"
    ).eval()
    seen = _rows_per_block(gp)
    out = gp(ids, mask, num_samples=5)
    assert seen == [(0, (3,)), (1, (3,))] and (out[:, 1:] - out[:, :1]).abs().max() > 1e-6
    det_seen.clear()
    det.train()(ids, mask, num_samples=5)
    assert det_seen == [(0, (5, 3)), (1, (5, 3))]


def test_late_repeat_matches_repeating_at_the_embedding(monkeypatch):
    """The same seed gives the same draws whether the batch is repeated before the first sampling
    block (the default) or at the embedding (every block forced to count as sampling)."""
    from gpattn.models._blocks import Block

    torch.manual_seed(0)
    ids, mask = _ids(B=4)
    model = TransformerClassifier(
        3, vocab_size=30, embed_dim=16, num_heads=2, num_layers=3, attention="sgpa", attention_layers=[1, 2]
    ).eval()
    torch.manual_seed(1)
    late = model(ids, mask, num_samples=6)
    monkeypatch.setattr(Block, "samples", property(lambda self: True))
    torch.manual_seed(1)
    early = model(ids, mask, num_samples=6)
    assert (late[:, 1:] - late[:, :1]).abs().max() > 1e-6
    torch.testing.assert_close(late, early, rtol=1e-5, atol=1e-6)

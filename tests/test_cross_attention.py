"""GP cross-attention (docs/derivations.md §13): queries from x (T tokens), keys and values from a context
(S ≠ T tokens), key padding on the context. Every variant that takes it against a dense float64 reference
(the GP variants' posterior mean, covariance and loss terms, and their samples' moments), the self-attention
limit (context = a copy of x), gradients, the errors, and a decoder layer that learns a copy task through
its cross-attention where a zero-attention control cannot."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from _cgp_helpers import ExactCGP, SeparateMeanExactCGP, mean_option

import gpattn
from gpattn.attention.registry import attention_class
from gpattn.testing import assert_samples_match_moments, layer_loss_terms
from gpattn.testing.references import (
    cgp_cross_dense_posterior,
    gram_dense,
    scgp_cross_dense_posterior,
    sgpa_cross_dense_posterior,
    sgpa_decoupled_cross_dense_posterior,
)

F64 = torch.float64
D, H, T, S = 8, 2, 4, 6
CROSS = [n for n in gpattn.list_attention() if attention_class(n).cross_attention]
ATTENTION = ["softmax", "kernel", "kernel-asym", "sto", "h-sto"]


def _inputs(B=2, seed=0, dtype=F64):
    """x (B, T, D), context (B, S, D) and the context's padding: row 1 pads its last two keys."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=dtype)
    context = torch.randn(B, S, D, generator=g, dtype=dtype)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[1, S - 2 :] = True
    return x, context, mask


def _layer(name, **options):
    """A float64 layer moved off its initialisation (zero maps, identity covariances)."""
    torch.manual_seed(0)
    layer = gpattn.build_attention(name, D, H, **options).to(F64)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def test_the_variants_that_take_cross_attention():
    """Every variant but kep-svgp (whose output at token t adds the query- and key-side GPs of t)."""
    assert sorted(CROSS) == sorted(set(gpattn.list_attention()) - {"kep-svgp"})
    assert attention_class("kep-svgp").no_cross_attention


# ------------------------------------------------------------------ the attention variants, densely
def _heads(layer, inp):
    """Per-head projections of ``inp`` by name, from the fused weight.  # shape: -> each (B, H, n, d)"""
    W, b = layer.in_proj.weight.detach(), layer.in_proj.bias.detach()
    parts = (inp @ W.T + b).split(layer._proj_widths, -1)
    return {n: p.reshape(*p.shape[:2], H, -1).transpose(1, 2) for n, p in zip(layer.projections, parts)}


def _attention_reference(name, layer, x, context, excluded):
    """The noise-free head outputs of an attention variant by its formula (docs/derivations.md §1–4), excluded
    keys (B, 1 or H, T, S) left out.  # shape: -> (B, T, D) after W_o"""
    pq, pk = _heads(layer, x), _heads(layer, context)
    if name in ("kernel", "kernel-asym"):
        q, k = (pq["qk"], pk["qk"]) if name == "kernel" else (pq["q"], pk["k"])
        heads = gram_dense(layer.kernel, q, k).masked_fill(excluded, 0.0) @ pk["v"]
    else:
        k, scale = pk["k"], math.sqrt(D // H)
        if name == "sto":
            scale = layer.tau
        if name == "h-sto":  # keys through the centroids (eqs. 14-16), soft, shared centroids
            C = layer.centroids.detach()
            k, scale = torch.softmax(k @ C / layer.tau1, -1) @ C.T, layer.tau2
        scores = (pq["q"] @ k.mT / scale).masked_fill(excluded, float("-inf"))
        heads = torch.softmax(scores, -1) @ pk["v"]
    return layer.out_proj(heads.transpose(1, 2).reshape(x.shape[0], T, -1)).detach()


@pytest.mark.parametrize("name", ATTENTION)
def test_attention_variants_match_the_dense_formula(name):
    """Noise-free cross-attention with key padding (gpattn's call and nn.MultiheadAttention's) and with a
    per-query (T, S) mask equals the variant's formula on x's queries and the context's keys and values."""
    layer = _layer(name)
    x, context, mask = _inputs()
    with gpattn.deterministic():
        y = layer(x, mask, context=context)
        y_mha, _ = layer(x, context, context, key_padding_mask=mask)
        torch.testing.assert_close(y, _attention_reference(name, layer, x, context, mask[:, None, None, :]))
        torch.testing.assert_close(y_mha, y)
        per_query = torch.rand(T, S, generator=torch.Generator().manual_seed(3)) < 0.4
        per_query[:, 0] = False  # every query keeps a key
        y_pq = layer(x, context=context, attn_mask=per_query)
        torch.testing.assert_close(y_pq, _attention_reference(name, layer, x, context, per_query[None, None]))


@pytest.mark.parametrize("name", ["softmax", "kernel", "sto"])
def test_weights_are_over_the_keys(name):
    layer = _layer(name)
    x, context, mask = _inputs()
    with gpattn.deterministic():
        _, w = layer(x, context, context, key_padding_mask=mask, need_weights=True, average_attn_weights=False)
    assert w.shape == (2, H, T, S)
    assert torch.equal(w[1, ..., S - 2 :], torch.zeros(H, T, 2))


# ------------------------------------------------------------------ the GP variants, densely
GP_CASES = {
    "sgpa-zero-full": ("sgpa", {"jitter": 0.0, "prior_mean": "zero"}, sgpa_cross_dense_posterior),
    "sgpa-attention-full": ("sgpa", {"jitter": 0.0}, sgpa_cross_dense_posterior),
    "sgpa-attention-diag": ("sgpa", {"jitter": 0.0, "covariance": "diag"}, sgpa_cross_dense_posterior),
    "decoupled-zero-full": (
        "sgpa-decoupled", {"jitter": 0.0, "prior_mean": "zero", "covariance": "full", "num_global": 3},
        sgpa_decoupled_cross_dense_posterior,
    ),
    "decoupled-attention-diag": (
        "sgpa-decoupled", {"jitter": 0.0, "num_global": 3}, sgpa_decoupled_cross_dense_posterior,
    ),
    "cgp": (ExactCGP, {}, cgp_cross_dense_posterior),
    "scgp": ("scgp", {"jitter": 0.0, "num_inducing": 3, "num_inducing_keys": 4}, scgp_cross_dense_posterior),
    "cgp-softmax": (ExactCGP, {"prior_mean": "softmax"}, cgp_cross_dense_posterior),
    "scgp-softmax": (  # cgp's mean, an object for scgp (a fresh one per layer: _gp_layer)
        "scgp", {"jitter": 0.0, "num_inducing": 3, "num_inducing_keys": 4, "prior_mean": "cgp-softmax"},
        scgp_cross_dense_posterior,
    ),
    "cgp-separate": (SeparateMeanExactCGP, {}, cgp_cross_dense_posterior),
    "scgp-separate": (
        "scgp", {"jitter": 0.0, "num_inducing": 3, "num_inducing_keys": 4, "prior_mean": "softmax-separate"},
        scgp_cross_dense_posterior,
    ),
}


def _gp_layer(case):
    name, options, reference = GP_CASES[case]
    if options.get("prior_mean") == "cgp-softmax":
        options = {**options, "prior_mean": mean_option("softmax")}
    layer = _layer(name, **options)
    if name in ("sgpa", "sgpa-decoupled"):  # a smaller prior variance than 0.01 would make the test trivial
        layer.scale_prior(20.0)
    return layer, reference


@pytest.mark.parametrize("case", list(GP_CASES))
def test_gp_posterior_matches_the_dense_reference(case):
    """``posterior(x, key_padding_mask, context=...)`` (mean and covariance over the T queries) and the loss
    terms of a forward equal the dense reference run on each sequence's truncated context (padded keys
    removed), T ≠ S."""
    layer, reference = _gp_layer(case)
    x, context, mask = _inputs()
    post = layer.posterior(x, mask, context=context)
    assert post.batch_shape == (2, H, layer.value_dim) and post.event_shape == (T,)
    refs = [reference(layer, x[b : b + 1], context[b : b + 1, : int((~mask[b]).sum())]) for b in range(2)]
    mean = torch.cat([r.mean for r in refs])
    cov = torch.cat([r.covariance for r in refs])
    torch.testing.assert_close(post.mean, mean, rtol=1e-9, atol=1e-10)
    if getattr(getattr(layer.strategy, "covariance", None), "name", None) == "diag":
        torch.testing.assert_close(post.variance, cov.diagonal(dim1=-2, dim2=-1), rtol=1e-8, atol=1e-10)
    else:
        torch.testing.assert_close(post.covariance_matrix, cov, rtol=1e-8, atol=1e-10)
    with gpattn.deterministic():
        layer(x, mask, context=context)
        terms = layer_loss_terms(layer)
        truncated = []  # the regulariser (cgp, scgp) has no dense reference: the truncated contexts' terms
        for b in range(2):
            layer(x[b : b + 1], context=context[b : b + 1, : int((~mask[b]).sum())])
            truncated.append(layer_loss_terms(layer))
    for key in refs[0].loss_terms:
        expected = refs[0].loss_terms[key] if key == "kl_global" else sum(r.loss_terms[key] for r in refs) / 2
        torch.testing.assert_close(terms[key], expected, rtol=1e-9, atol=1e-10)
    for key in terms:
        expected = truncated[0][key] if key == "kl_global" else (truncated[0][key] + truncated[1][key]) / 2
        torch.testing.assert_close(terms[key], expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", ["sgpa-zero-full", "sgpa-attention-diag", "decoupled-zero-full", "cgp", "scgp"])
def test_gp_samples_match_the_posterior(case):
    """Cross-attention draws of the heads (one factorisation, P samples) have the posterior's mean and
    covariance (5 standard errors), padded keys included."""
    layer, _ = _gp_layer(case)
    x, context, mask = _inputs()
    cond = layer._condition(x, mask, context)
    torch.manual_seed(5)
    f = cond.rsample(4000).transpose(-1, -2)  # shape: (P, B, H, Dv, T)
    post = cond.posterior()
    assert_samples_match_moments(f, post.mean, post.covariance_matrix)


# ------------------------------------------------------------------ the self-attention limit
@pytest.mark.parametrize("name", CROSS)
def test_context_equal_to_x_is_self_attention(name):
    """context = a copy of x (another tensor, so the cross path runs) gives the self-attention output at the
    real tokens and (GP variants) posterior, with key padding, and the same loss terms without padding (with
    padding, cgp's and scgp's regularisers and sgpa-rff's training covariance differ by design: in
    cross-attention the queries are not padded)."""
    options = {"jitter": 0.0} if name in ("sgpa", "sgpa-decoupled", "scgp") else {}
    layer = _layer(name, **options)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, S, D, generator=g, dtype=F64)
    _, _, mask = _inputs()
    for pad in (mask, None):
        with gpattn.deterministic():
            torch.manual_seed(2)  # cgp's regulariser draws prior samples
            y_self = layer(x, pad)
            self_terms = layer_loss_terms(layer)
            torch.manual_seed(2)
            y_cross = layer(x, pad, context=x.clone())
            cross_terms = layer_loss_terms(layer)
        real = 1.0 if pad is None else ~pad[..., None]
        torch.testing.assert_close(y_cross * real, y_self * real, rtol=1e-7, atol=1e-9)
    assert self_terms.keys() == cross_terms.keys()
    for key in self_terms:
        torch.testing.assert_close(cross_terms[key], self_terms[key], rtol=1e-7, atol=1e-9)
    if layer.is_gp:
        a, b = layer.posterior(x, mask), layer.posterior(x, mask, context=x.clone())
        torch.testing.assert_close(b.mean[0], a.mean[0], rtol=1e-7, atol=1e-9)
        if name != "sgpa-rff":  # its training covariance is the batch's: in cross-attention no query is padded
            torch.testing.assert_close(b.covariance_matrix[0], a.covariance_matrix[0], rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------ gradients and errors
@pytest.mark.parametrize("name", CROSS)
def test_gradients_reach_queries_context_and_parameters(name):
    layer = _layer(name)
    x, context, mask = _inputs()
    x.requires_grad_(True)
    context.requires_grad_(True)
    torch.manual_seed(0)
    y = layer(x, mask, context=context, num_samples=2)
    assert y.shape == (2, 2, T, D) and torch.isfinite(y).all()  # (P, B, T, D)
    loss = y.square().sum() + sum(layer_loss_terms(layer).values(), torch.zeros((), dtype=F64))
    loss.backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert torch.isfinite(context.grad).all() and context.grad[0].abs().sum() > 0
    leak = context.grad[1, S - 2 :].abs().max() / context.grad.abs().max()
    assert leak < 1e-12, f"padded keys must not be used (relative gradient {leak:.1e})"  # sgpa: round-off
    assert layer.in_proj.weight.grad.abs().sum() > 0 and layer.out_proj.weight.grad.abs().sum() > 0


def _raises(fn, *words):
    with pytest.raises(ValueError) as err:
        fn()
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.parametrize("name", ["softmax", "sgpa", "cgp"])
def test_bad_inputs_give_clear_errors(name):
    layer = _layer(name)
    x, context, mask = _inputs()
    _raises(lambda: layer(x, context=torch.randn(2, S, D + 1, dtype=F64)), "context", "embed_dim")
    _raises(lambda: layer(x, context=context[:1]), "batch size", "context")
    _raises(lambda: layer(x, context=context.float()), "dtype", "context")
    _raises(lambda: layer(x, mask[:, :T], context=context), "key_padding_mask", f"(2, {S})", "context")
    _raises(lambda: layer(x, context, context, is_causal=True), "is_causal=True in cross-attention", f"S={S}")
    _raises(lambda: layer(x, context, context.clone()), "key and value must be the same tensor")
    _raises(lambda: layer(x, context=context, attn_mask=torch.zeros(T, T, dtype=torch.bool)), f"({T}, {S})")
    if layer.is_gp:
        causal_like = torch.ones(T, S, dtype=torch.bool).triu(1)
        _raises(lambda: layer(x, context=context, attn_mask=causal_like), "in cross-attention", name)
        # a mask that pads is the keys' padding
        pads = mask[:, None, None, :].expand(2, 1, T, S)
        with gpattn.deterministic():
            torch.testing.assert_close(layer(x, context=context, attn_mask=pads), layer(x, mask, context=context))


def test_causal_cross_attention_with_as_many_queries_as_keys():
    """is_causal with T == S is the (T, T) causal mask for the attention variants; a GP variant refuses it
    (its per-query masks are defined for self-attention)."""
    x, context, _ = _inputs()
    context = context[:, :T]
    layer = _layer("softmax")
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    y, _ = layer(x, context, context, is_causal=True)
    torch.testing.assert_close(y, layer(x, context=context, attn_mask=causal))
    _raises(lambda: _layer("sgpa")(x, context, context, is_causal=True), "in cross-attention", "sgpa")


def test_variants_that_refuse_say_why():
    layer = _layer("kep-svgp")
    x, context, mask = _inputs()
    for call in (lambda: layer(x, mask, context=context), lambda: layer(x, context, context),
                 lambda: layer.posterior(x, context=context)):
        _raises(call, "'kep-svgp' does not take cross-attention", "same token")

    class SelfOnly(gpattn.attention.AttentionBase):  # a variant that did not opt in: an error, not a silent self
        def _attend(self, call):
            p = self.project(call.x)
            return p["v"]

    _raises(lambda: SelfOnly(D, H).to(F64)(x, context=context), "does not take cross-attention", "cross_attention")


def test_a_user_variant_opts_in():
    """A variant that declares ``cross_attention`` reads the keys' input as ``call.kv_input`` (the context,
    or x in self-attention) and gets the keys' padding."""

    class MeanOfValues(gpattn.attention.AttentionBase):
        projections = ("v",)
        cross_attention = True

        def _attend(self, call):
            v = self.project(call.kv_input)["v"]  # shape: (B, H, S, Dv)
            w = (~call.mask[:, None, :, None]).to(v.dtype) if call.mask is not None else torch.ones_like(v[..., :1])
            return ((w * v).sum(-2, keepdim=True) / w.sum(-2, keepdim=True)).expand(-1, -1, call.x.shape[1], -1)

    layer = MeanOfValues(D, H).to(F64)
    x, context, mask = _inputs()
    y = layer(x, mask, context=context)
    n = (~mask).sum(-1)[:, None, None]  # shape: (B, 1, 1)
    expected = layer.out_proj((layer.in_proj(context) * ~mask[..., None]).sum(1, keepdim=True) / n)
    torch.testing.assert_close(y, expected.expand(-1, T, -1))


# ------------------------------------------------------------------ a decoder layer that must attend
VOCAB, SRC, TGT = 8, 6, 4


class ZeroCrossAttention(nn.Module):
    """The control: nn.MultiheadAttention's call returning zeros (the decoder never sees the encoder)."""

    def forward(self, query, key, value, **kwargs):
        return torch.zeros_like(query), None


class CopyDecoder(nn.Module):
    """The encoder's tokens (embedding + position) are the memory; each decoder query names a source
    position and must output the token there. Only the cross-attention can carry it."""

    def __init__(self, cross: nn.Module, width: int = 32):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width)
        self.src_pos = nn.Embedding(SRC, width)
        self.ask = nn.Embedding(SRC, width)
        self.layer = nn.TransformerDecoderLayer(width, 2, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.layer.multihead_attn = cross
        self.head = nn.Linear(width, VOCAB)

    def forward(self, src, asked, pad):
        memory = self.tokens(src) + self.src_pos.weight[: src.shape[1]]
        out = self.layer(self.ask(asked), memory, memory_key_padding_mask=pad)
        return self.head(out)  # shape: (B, TGT, VOCAB)


def copy_batch(n: int, generator: torch.Generator):
    """Source tokens (n, SRC) with 0–2 padded positions at the end, the asked positions (n, TGT), the
    padding (n, SRC) and the targets (n, TGT)."""
    src = torch.randint(VOCAB, (n, SRC), generator=generator)
    length = SRC - torch.randint(3, (n,), generator=generator)
    pad = torch.arange(SRC)[None] >= length[:, None]
    asked = (torch.rand(n, TGT, generator=generator) * length[:, None]).long()
    return src, asked, pad, src.gather(1, asked)


def train_copy(cross: nn.Module, steps: int = 300, seed: int = 0) -> float:
    """Train a :class:`CopyDecoder` with ``cross`` as its cross-attention (the deep-GP ELBO of
    gpattn.objectives with the GP layer's loss terms) and return its test accuracy (posterior mean)."""
    torch.manual_seed(seed)
    model = CopyDecoder(cross)
    g = torch.Generator().manual_seed(seed)
    objective = gpattn.objectives.DeepGPELBO(model, num_data=steps * 64)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        src, asked, pad, target = copy_batch(64, g)
        logits = model(src, asked, pad)
        loss = objective(logits.reshape(-1, 1, VOCAB), target.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    src, asked, pad, target = copy_batch(1000, torch.Generator().manual_seed(seed + 1000))
    with torch.no_grad(), gpattn.deterministic():
        return (model(src, asked, pad).argmax(-1) == target).double().mean().item()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sgpa", "kernel"])
def test_decoder_with_gp_cross_attention_learns_to_copy(name):
    """nn.TransformerDecoderLayer with its multihead_attn replaced learns to copy the asked source token;
    the same decoder whose cross-attention returns zeros stays at chance (1/8)."""
    accuracy = train_copy(gpattn.build_attention(name, 32, 2, batch_first=True))
    control = train_copy(ZeroCrossAttention())
    assert control < 0.25, control
    assert accuracy > 0.9, accuracy


@pytest.mark.parametrize("name", ["softmax", "sgpa-decoupled"])
def test_sequence_first_mha_call(name):
    """nn.MultiheadAttention's (T, B, D) layout (``batch_first=False``) in cross-attention: the same output."""
    x, context, mask = _inputs()
    first = _layer(name)
    seq = _layer(name, batch_first=False)
    memory = context.transpose(0, 1)  # shape: (S, B, D), one tensor as key and value
    with gpattn.deterministic():
        y, _ = seq(x.transpose(0, 1), memory, memory, key_padding_mask=mask)
        torch.testing.assert_close(y.transpose(0, 1), first(x, mask, context=context))

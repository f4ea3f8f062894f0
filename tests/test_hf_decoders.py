"""gpattn layers inside Hugging Face decoders (GPT-2, Llama): swap, causal masks, rotary embeddings, the
LM objective, generation and per-token uncertainty. Tiny randomly initialised models only (no download).
Skips when ``transformers`` is missing."""

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

import gpattn

transformers = pytest.importorskip("transformers")

from gpattn.integrations._decoders import _rotation  # noqa: E402
from gpattn.integrations.huggingface import (  # noqa: E402
    CausalLMELBO,
    HFDecoderAdapter,
    decoder_variants,
    generate_with_uncertainty,
    predictive_uncertainty,
    supported_architectures,
    swap_attention,
    token_uncertainty,
)
from gpattn.objectives import summed_loss_terms  # noqa: E402

V = 40  # vocabulary
SPECIAL = dict(bos_token_id=0, eos_token_id=None, pad_token_id=0)


def gpt2(impl="sdpa", **kw):
    config = transformers.GPT2Config(
        vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, attn_implementation=impl, **SPECIAL, **kw
    )
    return transformers.GPT2LMHeadModel(config)


def llama(impl="sdpa", **kw):
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=impl, **SPECIAL, **kw,
    )  # grouped-query attention: 2 key-value heads for 4 query heads
    return transformers.LlamaForCausalLM(config)


MODELS = {"gpt2": gpt2, "llama": llama}


def batch(seed=0, B=2, T=7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[-1, :3] = 0  # left padding, as for generation
    return ids, mask


def build(name, seed=0, **kw):
    torch.manual_seed(seed)
    return MODELS[name](**kw).eval()


# ----------------------------------------------------------------------------- the softmax swap is the model
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(
    "dtype,impl", [(torch.float32, "sdpa"), (torch.float32, "eager"), (torch.float64, "sdpa")]
)
def test_softmax_swap_reproduces_the_decoder(name, dtype, impl):
    """Logits to 1e-5, with and without (left) padding (compared on real tokens). Float64 runs the sdpa masks:
    transformers' eager Llama softmax is float32 (3e-8 off in float64), and its float64 eager mask makes NaN
    rows at padded queries that reach later layers."""
    model = build(name, impl=impl).to(dtype)
    ids, mask = batch()
    with torch.no_grad():
        ref, ref_padded = model(ids).logits, model(ids, attention_mask=mask).logits
        adapters = swap_attention(model, "softmax", "all")
        out, out_padded = model(ids).logits, model(ids, attention_mask=mask).logits
    assert set(adapters) == {0, 1} and all(isinstance(a, HFDecoderAdapter) for a in adapters.values())
    assert all(a.new == [] for a in adapters.values())  # everything transferred
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    real = mask.bool()
    torch.testing.assert_close(out_padded[real], ref_padded[real], atol=1e-5, rtol=1e-5)


def test_gpt2_score_scale_is_folded_into_the_queries():
    """scale_attn_by_inverse_layer_idx divides layer i's scores by i + 1: the query rows carry it."""
    model = build("gpt2", scale_attn_by_inverse_layer_idx=True)
    ids, _ = batch()
    with torch.no_grad():
        ref = model(ids).logits
        adapters = swap_attention(model, "softmax", "all")
        out = model(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert adapters[1].transferred["in_proj[q]"] == "c_attn[query] x 0.5"


def test_what_is_transferred_llama_gqa():
    """sgpa's shared query-key map takes the key rows, each of the 2 key-value heads repeated to 2 query
    heads (head h ← key-value head h // 2); Llama has no biases: the layer's start at 0."""
    model = build("llama")
    old = model.model.layers[1].self_attn
    k, v, o = (old.k_proj.weight.clone(), old.v_proj.weight.clone(), old.o_proj.weight.clone())
    adapter = swap_attention(model, "sgpa")[1]
    layer = adapter.attention
    assert adapter.transferred == {
        "in_proj[qk]": "k_proj (2 key-value heads repeated x2)",
        "in_proj[v]": "v_proj (2 key-value heads repeated x2)",
        "out_proj": "o_proj",
    }
    assert adapter.new and all(not n.startswith(("in_proj", "out_proj")) for n in adapter.new)
    qk, vv = layer.in_proj.weight.detach().split(32)
    for h in range(4):
        torch.testing.assert_close(qk[8 * h : 8 * h + 8], k[8 * (h // 2) : 8 * (h // 2) + 8], rtol=0, atol=0)
        torch.testing.assert_close(vv[8 * h : 8 * h + 8], v[8 * (h // 2) : 8 * (h // 2) + 8], rtol=0, atol=0)
    torch.testing.assert_close(layer.out_proj.weight.detach(), o, rtol=0, atol=0)
    assert not layer.in_proj.bias.any() and not layer.out_proj.bias.any()
    assert model.config.use_cache is False and model.generation_config.use_cache is False  # the recompute policy


def test_rotation_is_llamas_rope_on_queries_and_keys_only():
    """The hook rotates q, k and a shared qk as transformers' apply_rotary_pos_emb does, values untouched."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = build("llama")
    x = torch.randn(2, 5, 32)
    cos, sin = model.model.rotary_emb(x, torch.arange(5)[None])
    for variant, names in (("softmax", ("q", "k")), ("sgpa", ("qk",))):
        layer = swap_attention(build("llama"), variant)[1].attention
        with torch.no_grad(), _rotation((cos, sin)):
            raw = F.linear(x, layer.in_proj.weight, layer.in_proj.bias).split(layer._proj_widths, -1)
            plain = {n: layer.split_heads(p) for n, p in zip(layer.projections, raw)}
            rotated = layer.project(x)
        for n in names:
            torch.testing.assert_close(rotated[n], apply_rotary_pos_emb(plain[n], plain[n], cos, sin)[0])
        torch.testing.assert_close(rotated["v"], plain["v"], rtol=0, atol=0)
        with pytest.raises(ValueError, match="HFDecoderAdapter"):
            layer.project(x)  # outside the adapter: no positions


# ----------------------------------------------------------------------------- every causal variant
@pytest.mark.parametrize("name", MODELS)
def test_each_supported_variant_swaps_and_is_causal(name):
    """Every offered variant runs in both layers; under gpattn.deterministic() position t's logits do not
    change when a later token does (the causal mask reaches the layer, also as transformers' None)."""
    ids, mask = batch()
    later = ids.clone()
    later[:, 5:] = (later[:, 5:] + 1) % V
    offered = decoder_variants(rotary=name == "llama")
    assert {"softmax", "sgpa", "sgpa-decoupled"} <= set(offered) and not {"cgp", "scgp", "kep-svgp"} & set(offered)
    for variant in offered:
        model = build(name)
        swap_attention(model, variant, "all")
        with torch.no_grad(), gpattn.deterministic():
            a, b = model(ids).logits, model(later).logits
            padded = model(ids, attention_mask=mask).logits
        assert torch.isfinite(a).all() and torch.isfinite(padded[mask.bool()]).all(), variant
        torch.testing.assert_close(a[:, :5], b[:, :5], msg=variant)
        assert not torch.allclose(a[:, 5:], b[:, 5:]), variant


@pytest.mark.parametrize("variant", ["cgp", "scgp", "kep-svgp"])
def test_variants_without_causal_masks_are_refused(variant):
    with pytest.raises(ValueError, match=rf"attention '{variant}' cannot replace GPT2Attention.*masks that pad.*sgpa"):
        swap_attention(build("gpt2"), variant)


def test_h_sto_is_refused_in_a_rotary_model_only():
    swap_attention(build("gpt2"), "h-sto")
    with pytest.raises(ValueError, match=r"'h-sto' cannot replace LlamaAttention.*rotary.*centroid.*sgpa"):
        swap_attention(build("llama"), "h-sto")


def test_unsupported_models_and_inputs_name_the_fix():
    assert {"GPT2Attention", "LlamaAttention"} <= set(supported_architectures())
    with pytest.raises(ValueError, match=r"decoders whose self-attention is one of GPT2Attention, LlamaAttention"):
        swap_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)), "sgpa")
    with pytest.raises(ValueError, match=r"config.head_dim \(16\).*hidden_size // num_attention_heads"):
        swap_attention(build("llama", head_dim=16), "sgpa")
    model = build("llama")
    swap_attention(model, "sgpa")
    ids, _ = batch()
    with pytest.raises(ValueError, match="use_cache=False"):
        model(ids, use_cache=True)
    with pytest.raises(ValueError, match="use_cache=False"):
        model.generate(ids, max_new_tokens=2, use_cache=True)
    with pytest.raises(ValueError, match="not LlamaAttention .already swapped"):
        swap_attention(model, "sgpa")
    swap_attention(model, "sgpa", [0])
    with pytest.raises(ValueError, match="layer 0's self_attn is HFDecoderAdapter, not LlamaAttention .already"):
        swap_attention(model, "sgpa", "all")  # every layer swapped: still recognised as Llama


# ----------------------------------------------------------------------------- training and generation
@torch.no_grad()
def away_from_the_prior(adapters, scale=0.3):
    """Every new (GP) parameter moved by noise, so that the KL terms are not 0 (the variational start is the prior)."""
    for adapter in adapters.values():
        for name, param in adapter.attention.named_parameters():
            if name in adapter.new:
                param.add_(scale * torch.randn_like(param))


@pytest.mark.parametrize("name,variant", [("gpt2", "sgpa"), ("llama", "sgpa"), ("llama", "sgpa-decoupled")])
def test_one_training_step_through_the_lm_loss_and_gp_terms(name, variant):
    """loss = mean token CE + (B / n)·(β kl_seq + β kl_global / N), finite; every GP parameter gets a
    gradient and moves."""
    torch.manual_seed(1)
    model = MODELS[name]().train()
    adapters = swap_attention(model, variant, "all")
    away_from_the_prior(adapters)
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    objective = CausalLMELBO(model, num_data=100, combine_terms=False)
    parts = objective(model(ids, attention_mask=mask).logits, labels)
    loss = parts["loss"]
    n = int((labels[:, 1:] != -100).sum())
    terms = summed_loss_terms(model)
    term = "kl_seq" if variant == "sgpa" else "kl_global"
    assert set(terms) == {term} and float(terms[term].detach()) > 0
    weight = 1.0 if variant == "sgpa" else 1 / 100
    torch.testing.assert_close(loss, parts["nll"] + weight * terms[term] * 2 / n)
    assert torch.isfinite(loss)
    gp = {f"{i}.{p}": param for i, a in adapters.items() for p, param in a.attention.named_parameters() if p in a.new}
    before = {k: p.detach().clone() for k, p in gp.items()}
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.any() for p in gp.values()), [
        k for k, p in gp.items() if p.grad is None or not p.grad.any()
    ]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert all(not torch.equal(before[k], gp[k].detach()) for k in gp)


def test_lm_objective_with_global_terms_and_data_term():
    """sgpa-decoupled (kl_global only): the loss is transformers' own LM loss + (B / n)·β·kl_global / N."""
    model = build("llama")
    away_from_the_prior(swap_attention(model, "sgpa-decoupled", "all"))
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)  # eval mode: the GP layers record no loss term
    with pytest.warns(UserWarning, match="eval mode.*the data term alone"):
        assert CausalLMELBO(model, num_data=50, beta=0.5)(out.logits, labels) == out.loss
    model.train()
    torch.manual_seed(0)
    out = model(ids, attention_mask=mask, labels=labels)
    loss = CausalLMELBO(model, num_data=50, beta=0.5)(out.logits, labels)
    n = int((labels[:, 1:] != -100).sum())
    terms = summed_loss_terms(model)
    assert set(terms) == {"kl_global"} and float(terms["kl_global"].detach()) > 1
    torch.testing.assert_close(loss, out.loss + 0.5 * terms["kl_global"] / 50 * 2 / n)
    with pytest.raises(ValueError, match="no token to predict"):
        CausalLMELBO(model, num_data=50)(out.logits, torch.full_like(labels, -100))


@pytest.mark.parametrize("name", MODELS)
def test_generate_20_tokens(name):
    """A softmax swap generates what the original generates with its key/value cache (greedy); a sampling
    sgpa swap generates 20 tokens."""
    ids, _ = batch(B=1)
    model = build(name)
    ref = model.generate(ids, max_new_tokens=20, do_sample=False)
    swap_attention(model, "softmax", [0])
    assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False), ref)
    model = build(name)
    swap_attention(model, "sgpa", "all")
    out = model.generate(ids, max_new_tokens=20, do_sample=True)
    assert out.shape == (1, ids.shape[1] + 20) and torch.equal(out[:, : ids.shape[1]], ids)


# ----------------------------------------------------------------------------- uncertainty per token
def _brute_force(logits):
    """Entropy, expected entropy and MI per (b, t) by loops, float64.  # logits (B, P, T, V)"""
    B, P, T, _ = logits.shape
    out = torch.zeros(3, B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            ps = [torch.softmax(logits[b, p, t].double(), -1) for p in range(P)]
            mean = sum(ps) / P
            H = -sum(float(m) * math.log(float(m)) for m in mean)
            EH = sum(-sum(float(q) * math.log(float(q)) for q in p) for p in ps) / P
            out[:, b, t] = torch.tensor([H, EH, H - EH], dtype=torch.float64)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_token_uncertainty_against_brute_force(name):
    model = build(name)
    swap_attention(model, "sgpa")
    ids, mask = batch()
    torch.manual_seed(5)
    u = token_uncertainty(model, ids, mask, num_samples=3)
    torch.manual_seed(5)
    with torch.no_grad():
        logits = torch.stack([model(input_ids=ids, attention_mask=mask).logits for _ in range(3)], 1)
    ref = _brute_force(logits)
    assert u.entropy.shape == u.mutual_information.shape == u.expected_entropy.shape == (2, 7)
    assert u.probs.shape == (2, 7, V)
    for got, want in zip((u.entropy, u.expected_entropy, u.mutual_information), ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert (u.mutual_information >= 0).all()
    assert (u.mutual_information[mask.bool()] > 1e-6).all()  # the GP layer samples (padded queries: output 0)
    with gpattn.deterministic():  # nothing random: one pass, MI 0
        assert not token_uncertainty(model, ids, mask, num_samples=3).mutual_information.any()


def test_mutual_information_of_a_deterministic_swap_is_zero():
    """A softmax swap: P passes agree, MI = 0 to round-off (here through the formula on P copies)."""
    model = build("gpt2")
    swap_attention(model, "softmax")
    ids, mask = batch()
    u = token_uncertainty(model, ids, mask, num_samples=4)
    assert not u.mutual_information.any()
    logits = model(ids, attention_mask=mask).logits.detach()
    copies = predictive_uncertainty(logits[:, None].expand(-1, 4, -1, -1))
    assert float(copies.mutual_information.abs().max()) < 1e-12
    torch.testing.assert_close(copies.entropy, u.entropy)
    torch.testing.assert_close(copies.entropy, copies.expected_entropy)
    with pytest.raises(ValueError, match=r"\(B, P, T, V\)"):
        predictive_uncertainty(logits)


def test_generate_with_uncertainty_per_generated_token():
    """Shapes (B, 20); the values are token_uncertainty's on the generated sequences, from the position that
    predicts the first generated token (T0 − 1) on (same random numbers)."""
    model = build("llama")
    swap_attention(model, "sgpa", "all")
    ids, mask = batch()
    settings = dict(max_new_tokens=20, do_sample=True)
    torch.manual_seed(3)
    seq, u = generate_with_uncertainty(model, ids, mask, num_samples=3, **settings)
    assert seq.shape == (2, 27) and u.entropy.shape == u.mutual_information.shape == (2, 20)
    assert u.probs.shape == (2, 20, V) and (u.mutual_information >= 0).all() and torch.isfinite(u.entropy).all()
    torch.manual_seed(3)
    again = model.generate(input_ids=ids, attention_mask=mask, **settings)
    full = token_uncertainty(model, again, torch.cat([mask, torch.ones(2, 20, dtype=torch.long)], 1), num_samples=3)
    assert torch.equal(again, seq)
    torch.testing.assert_close(u.entropy, full.entropy[:, 6:26], rtol=0, atol=0)
    torch.testing.assert_close(u.mutual_information, full.mutual_information[:, 6:26], rtol=0, atol=0)


def test_state_dict_round_trip_and_copies():
    """The rotation hook is not state: a fresh swap loads the state dict; copies and pickles keep the hook."""
    model = build("llama")
    swap_attention(model, "sgpa-decoupled", "all")
    fresh = build("llama", seed=1)
    swap_attention(fresh, "sgpa-decoupled", "all")
    fresh.load_state_dict(model.state_dict(), strict=True)
    ids, _ = batch()
    with torch.no_grad(), gpattn.deterministic():
        want = model(ids).logits
        for other in (fresh, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            torch.testing.assert_close(other(ids).logits, want)


def test_output_attentions_leaves_the_swapped_layers_out():
    """transformers records attention weights by module class: the swapped layer (which returns None) is absent."""
    model = build("gpt2", impl="eager")
    swap_attention(model, "sgpa")
    ids, mask = batch()
    out = model(ids, attention_mask=mask, output_attentions=True)
    assert len(out.attentions) == 1 and out.attentions[0].shape == (2, 4, 7, 7)  # layer 0, not swapped

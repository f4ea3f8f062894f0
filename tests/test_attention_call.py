"""The explicit attention call: a forward prepares one AttentionCall, the variant returns what it drew, and
nothing of the forward is written on the layer but its two records (loss terms, diagnostics), in their holder."""

import pytest
import torch

from gpattn import deterministic
from gpattn.attention import Attended, AttentionCall, build_attention, list_attention


def _snapshot(module: torch.nn.Module) -> dict:
    """Every attribute of every module of the tree, by identity (a forward that sets or replaces one changes it)."""
    return {(path, k): id(v) for path, m in module.named_modules() for k, v in vars(m).items()}


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[1, 3:] = True
    mask[2] = True  # an all-padding row
    return x, mask


@pytest.mark.parametrize("name", list_attention())
def test_a_forward_writes_no_attribute_on_the_layer(name):
    layer = build_attention(name, 16, 2)
    x, mask = _inputs()
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    layer(x, mask, 3)  # the first forward registers the layer's loss terms (GPyTorch's registry, by name)
    for training in (True, False):
        layer.train(training)
        before = _snapshot(layer)
        layer(x, mask)
        layer(x, mask, 3)
        with deterministic():
            layer(x, mask, 2)
        layer(x, x, x, mask, True)  # nn.MultiheadAttention's call, weights wanted
        if layer.per_query_masks:
            layer(x, mask, attn_mask=causal)
        layer(x[:0], mask[:0])
        assert _snapshot(layer) == before, sorted(set(_snapshot(layer).items()) ^ set(before.items()))


@pytest.mark.parametrize("name", list_attention())
def test_the_records_are_this_forwards(name):
    """The loss terms and diagnostics a forward leaves are its own: an eval-mode forward after a training
    one leaves no diagnostics and no loss terms (they are training's: evaluation computes none), and a training
    forward of a batch without padding replaces the terms."""
    layer = build_attention(name, 16, 2)
    x, mask = _inputs()
    layer.train()(x, mask)
    terms = dict(layer.named_added_loss_terms())
    if layer.is_gp:
        assert layer.diagnostics() and terms
    layer.eval()(x)
    assert layer.diagnostics() == {} and dict(layer.named_added_loss_terms()) == {} and layer.loss_terms() == {}
    layer.train()(x)
    again = dict(layer.named_added_loss_terms())
    assert again.keys() == terms.keys() and all(again[k] is not terms[k] for k in terms)


def test_attend_returns_the_weights_the_mha_call_returns():
    layer = build_attention("softmax", 16, 2)
    x, mask = _inputs()
    y, weights = layer.attend(x, mask, need_weights=True)
    y_mha, w_mha = layer(x, x, x, mask, True, average_attn_weights=False)
    torch.testing.assert_close(y, y_mha, rtol=0, atol=0)
    torch.testing.assert_close(weights, w_mha, rtol=0, atol=0)
    assert layer.attend(x, mask)[1] is None  # not asked for: none formed
    assert build_attention("sgpa", 16, 2).attend(x, mask, need_weights=True)[1] is None  # a GP variant has none


def test_attended_reads_every_return_form():
    heads, mean = torch.ones(2, 1, 3, 4), torch.zeros(2, 1, 3, 4)
    assert Attended.of(heads).heads is heads and Attended.of(heads).mean is None
    both = Attended.of((heads, mean))
    assert both.heads is heads and both.mean is mean
    out = Attended(heads, weights=mean)
    assert Attended.of(out) is out


def test_batch_mean_leaves_out_all_padding_rows():
    t = torch.tensor([1.0, 2.0, 6.0])
    assert float(AttentionCall(torch.zeros(3, 2, 4)).batch_mean(t)) == 3.0
    call = AttentionCall(torch.zeros(3, 2, 4), keep=torch.tensor([True, True, False]))
    assert float(call.batch_mean(t)) == 1.5


def test_a_variant_written_against_the_call():
    """A new variant implements ``_attend(call)`` only: it reads the input, the mask and the wish for weights."""
    from gpattn.attention import AttentionBase, excluded_keys

    class Uniform(AttentionBase):
        name = "uniform-test"

        def _attend(self, call):
            p = self.project(call.x)
            B, H, T, _ = p["v"].shape
            w = torch.ones(B, H, T, T)
            if call.mask is not None:
                w = w.masked_fill(excluded_keys(call.mask), 0)
            w = w / w.sum(-1, keepdim=True).clamp_min(1)
            return Attended(w @ p["v"], weights=w if call.need_weights else None)

    layer = Uniform(16, 2)
    x, mask = _inputs()
    y, w = layer.attend(x, mask, need_weights=True)
    assert y.shape == x.shape and w.shape == (3, 2, 5, 5)
    assert torch.equal(y[2], torch.zeros(5, 16))  # the all-padding row: output 0
    torch.testing.assert_close(w[1, :, :, 3:], torch.zeros(2, 5, 2))  # padded keys get no weight


@pytest.mark.parametrize(
    "name,layout",
    [  # D = 16, H = 2, Dv = 3: each "q", "k", "qk" H·Dh = 16 rows wide, "v" H·Dv = 6
        ("softmax", {"q": (0, 16), "k": (16, 32), "v": (32, 38)}),
        ("kernel", {"qk": (0, 16), "v": (16, 22)}),
    ],
)
def test_projection_rows_are_where_project_reads_each_projection(name, layout):
    """``projection_rows()``: each named projection's rows of the fused ``in_proj``, in order, covering it;
    the features of ``in_proj``'s output at those rows are what ``project`` returns under that name."""
    layer = build_attention(name, 16, 2, value_dim=3)
    rows = layer.projection_rows()
    assert {p: (r.start, r.stop) for p, r in rows.items()} == layout
    assert list(rows) == list(layer.projections) and layer.in_proj.weight.shape[0] == max(b for _, b in layout.values())
    x = torch.randn(2, 5, 16)
    fused, projected = layer.in_proj(x), layer.project(x)
    for p, r in rows.items():
        assert torch.equal(layer.split_heads(fused[..., r]), projected[p])


def test_the_core_stays_easy_to_read():
    """The attention contract's file stays short and no function of the core (every module but the
    experiment application) runs over 50 lines: the limits of issue #29, kept."""
    import ast
    from pathlib import Path

    import gpattn

    root = Path(gpattn.__file__).parent
    assert len((root / "attention" / "base.py").read_text().splitlines()) < 240
    long = [
        f"{path.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(root.rglob("*.py")) if "experiments" not in path.parts
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50
    ]
    assert not long, long

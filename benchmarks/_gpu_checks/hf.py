"""Check ``hf``: the Hugging Face swap on a tiny random BERT on the device against the CPU copy, ``HFClassifier``
(stream-scaled prior, frozen trunk), and ``gpattn train --encoder`` followed by ``load_run(...).predict``."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .compare import (
    TOL_F32_FACTOR,
    TOL_F32_FIXED,
    TOL_F32_FLOOR,
    compare_results,
    err,
    f32_tolerance,
    grad_errs,
    judge,
    off_device,
    placement,
    quantities,
    same_device,
    worst,
)
from .record import Recorder, fmt, require, verdict
from .sync import sync_events
from .train import TRAINING, cli, finite_metrics, metrics_subset

#: (attention, BERT attention implementation) of the swap steps
SWAPS = (("sgpa", "sdpa"), ("sgpa", "eager"), ("softmax", "sdpa"), ("softmax", "eager"), ("kernel", "sdpa"),
         ("sgpa-decoupled", "sdpa"), ("kep-svgp", "sdpa"))  # fmt: skip
#: a token batch for HFClassifier (0: padding)
TOKENS = [[2, 5, 7, 9, 3], [2, 8, 3, 0, 0], [2, 4, 4, 6, 3]]


def need_transformers():
    require("transformers")
    import transformers

    return transformers


def tiny_config(transformers, impl="sdpa", **kw):
    """A tiny BERT config, 2 layers and 2 heads (default width 32, vocabulary 100, no dropout); ``kw``
    overrides any field."""
    fields = dict(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertConfig(attn_implementation=impl, **{**fields, **kw})


def tiny_encoder(transformers, vocab_size=50, max_position_embeddings=24, **dropouts):
    """A tiny random BERT (width 16, 2 layers, 2 heads), seeded; ``dropouts``: the config's dropout
    probabilities (default 0: deterministic forwards)."""
    config = tiny_config(
        transformers, vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
        max_position_embeddings=max_position_embeddings, **dropouts,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertModel(config, add_pooling_layer=False)


def batch(B=3, T=7):
    """Token ids and an attention mask (rows 1 and 2 padded after 4 and 2 tokens)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    return ids, mask


def swapped_bert(transformers, attention: str, impl: str):
    """A tiny ``BertForSequenceClassification`` (2 labels) with every attention layer swapped, seeded."""
    from gpattn.integrations.huggingface import swap_attention

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(tiny_config(transformers, impl, num_labels=2))
    swap_attention(model, attention, "all")
    return model


def _sgd_step(model, dev, ids, mask, labels) -> dict:
    """A training step (SGD: linear in the gradients, unlike Adam) under gpattn.deterministic(), then eval
    forwards with and without the mask, and a sampled one."""
    import gpattn
    from gpattn.objectives import DeepGPELBO, named_added_loss_terms, summed_loss_terms

    model.train()
    objective = DeepGPELBO(model, num_data=100, combine_terms=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpattn.deterministic():
        torch.manual_seed(1)
        logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
        parts = objective(logits[:, None], labels.to(dev))
        terms = summed_loss_terms(model)
        added = len(list(named_added_loss_terms(model)))  # the training forward's (an eval forward records none)
    parts["loss"].backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    model.eval()
    with torch.no_grad(), gpattn.deterministic():
        ev = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
        ev_nomask = model(input_ids=ids.to(dev)).logits
    with torch.no_grad():
        torch.manual_seed(2)
        sampled = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
    return {
        "y": logits.detach(),
        "terms": {**{f"part:{k}": v.detach() for k, v in parts.items()}},
        "grads": grads,
        "after_step": {n: p.detach().clone() for n, p in model.named_parameters()},
        "eval": ev,
        "eval_nomask": ev_nomask,
        "sampled_finite": bool(torch.isfinite(sampled).all()),
        "term_names": sorted(terms),
        "added_loss_terms": added,
    }


def _step_syncs(model, device, ids, mask, labels) -> dict:
    """Host-device synchronisations of one training forward + backward of the device model (recorded)."""
    import gpattn
    from gpattn.objectives import DeepGPELBO

    ids_d, mask_d, labels_d = ids.to(device), mask.to(device), labels.to(device)

    def hf_forward():
        model.train()
        with gpattn.deterministic():
            logits = model(input_ids=ids_d, attention_mask=mask_d).logits
            return DeepGPELBO(model, num_data=100, combine_terms=False)(logits[:, None], labels_d)["loss"]

    return sync_events(lambda: hf_forward().backward(), device, hf_forward)


def _f32_yardstick(base, ref: dict, data: tuple):
    """(tolerances, the CPU's own float32-vs-float64 error): ``TOL_F32_FIXED`` if the model has no float64."""
    try:
        ref64 = _sgd_step(copy.deepcopy(base).double(), "cpu", *data)
        yard = compare_results(ref, ref64)
        return f32_tolerance(yard), max(quantities(yard).values())
    except Exception as exc:  # noqa: BLE001 - a model that does not run in float64: fixed tolerance
        return TOL_F32_FIXED, f"n/a ({type(exc).__name__})"


def _swap_failures(cmp: dict, got: dict, tol, yard_max, attention: str, device: str) -> list:
    import gpattn

    ok, bad = judge(cmp, tol, set())
    failures = [f"training step {device} vs cpu: {bad[:3]}"] if not ok else []
    k, worst_after = worst(cmp["after_step"])
    ev_norm = max(cmp["eval"]["norm"], cmp["eval_nomask"]["norm"])
    loose = TOL_F32_FIXED if isinstance(yard_max, str) else max(TOL_F32_FLOOR, TOL_F32_FACTOR * 10 * yard_max)
    if worst_after > loose or ev_norm > loose:
        failures.append(f"after the SGD step / eval: parameters {worst_after:.1e} ({k}), eval logits {ev_norm:.1e}")
    if not got["sampled_finite"]:
        failures.append("sampled eval logits not finite")
    gp = bool(gpattn.attention.attention_class(attention).is_gp)
    if gp and (not got["term_names"] or not got["added_loss_terms"]):
        failures.append(f"loss terms not reachable from the outer model: {got['term_names']}")
    return failures


def swap_step(device: str, attention: str, impl: str) -> dict:
    """The swapped BERT's training step and eval forwards on the device against the CPU copy."""
    base = swapped_bert(need_transformers(), attention, impl)
    data = (*batch(), torch.tensor([0, 1, 1]))
    ref = _sgd_step(copy.deepcopy(base), "cpu", *data)
    dev_model = copy.deepcopy(base).to(device)
    where = placement(dev_model, device)
    got = _sgd_step(dev_model, device, *data)
    sync = _step_syncs(dev_model, device, *data)  # recorded, not judged
    cmp = compare_results(got, ref)
    cmp["after_step"] = {k: err(got["after_step"][k], ref["after_step"][k]) for k in ref["after_step"]}
    cmp["eval"] = err(got["eval"], ref["eval"])
    cmp["eval_nomask"] = err(got["eval_nomask"], ref["eval_nomask"])
    tol, yard_max = _f32_yardstick(base, ref, data)
    failures = _swap_failures(cmp, got, tol, yard_max, attention, device)
    if off_device(where):
        failures.append(f"not on {device}: {where}")
    worst_after = worst(cmp["after_step"])[1]
    ev_norm = max(cmp["eval"]["norm"], cmp["eval_nomask"]["norm"])
    summary = (
        f"logits {fmt(cmp['y']['norm'])}, parts {fmt(worst(cmp['terms'])[1])}, grad {fmt(worst(cmp['grads'])[1])}, "
        f"after SGD {fmt(worst_after)}, eval {fmt(ev_norm)} (cpu f32 err {fmt(yard_max)}); terms {got['term_names']}"
        + (f"; syncs {sync['count']}" if sync.get("checked") else "")
    )
    res = {"compare": cmp, "placement": where, "term_names": got["term_names"], "cpu_f32_vs_f64": yard_max,
           "sync": sync}  # fmt: skip
    return verdict(res, summary, failures)


def bf16_step(device: str, attention: str) -> dict:
    """A bf16-autocast training step of the swapped BERT on the device: loss parts and gradients finite."""
    from gpattn.objectives import DeepGPELBO

    model = swapped_bert(need_transformers(), attention, "sdpa").to(device).train()
    ids, mask = (t.to(device) for t in batch())
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        logits = model(input_ids=ids, attention_mask=mask).logits
        parts = DeepGPELBO(model, num_data=100, combine_terms=False)(
            logits.float()[:, None], torch.tensor([0, 1, 1], device=device)
        )
    parts["loss"].backward()
    fin = {k: bool(torch.isfinite(v)) for k, v in parts.items()}
    grads = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    ok = all(fin.values()) and grads and bool(torch.isfinite(logits.float()).all())
    return {
        "parts_finite": fin,
        "grads_finite": grads,
        "logits_dtype": str(logits.dtype),
        "status": "pass" if ok else "fail",
        "summary": f"logits {logits.dtype}, loss parts finite {all(fin.values())}, gradients finite {grads}",
    }


def _classifier_on(base, dev: str) -> dict:
    """``HFClassifier``'s stream-scaled prior, a training step and a sampled forward on ``dev``."""
    import gpattn
    from gpattn.objectives import DeepGPELBO

    ids = torch.tensor(TOKENS).to(dev)
    pad, y = ids == 0, torch.tensor([0, 1, 1]).to(dev)
    model = copy.deepcopy(base).to(dev)
    rows = model.match_prior_to_stream(ids, pad)
    model.train()
    with gpattn.deterministic():
        logits = model(ids, pad, num_samples=3)
        parts = DeepGPELBO(model, num_data=30, combine_terms=False)(logits, y)
    parts["loss"].backward()
    diag = model.layer_diagnostics()
    with torch.no_grad():
        torch.manual_seed(0)
        sampled = model.eval()(ids, pad, num_samples=3)
    return {
        "rows": rows,
        "logits": logits.detach(),
        "parts": {k: v.detach() for k, v in parts.items()},
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "diag_devices": sorted({str(v.device) for r in diag for v in r.values() if torch.is_tensor(v)}),
        "sampled_finite": bool(torch.isfinite(sampled).all()),
    }


def classifier(device: str) -> dict:
    """``HFClassifier`` (sgpa on the last layer) on the device against the CPU."""
    transformers = need_transformers()
    from gpattn.integrations.huggingface import HFClassifier

    base = HFClassifier(tiny_encoder(transformers), 2, "sgpa", "last")
    out = {dev: _classifier_on(base, dev) for dev in ("cpu", device)}
    a, b = out[device], out["cpu"]
    factor = max(
        (abs(r1["factor"] - r2["factor"]) / abs(r2["factor"]) for r1, r2 in zip(a["rows"], b["rows"])), default=0.0
    )
    le = err(a["logits"], b["logits"])
    pe = {k: err(a["parts"][k], b["parts"][k]) for k in b["parts"]}
    ge = grad_errs(a["grads"], b["grads"])
    gk, gv = worst(ge)
    failures = []
    if factor > 1e-4 or le["norm"] > TOL_F32_FIXED or worst(pe)[1] > TOL_F32_FIXED or gv > 1e-2:
        failures.append(
            f"{device} vs cpu: prior factor {factor:.1e}, logits {le['norm']:.1e}, "
            f"parts {worst(pe)[1]:.1e}, grads {gv:.1e} ({gk})"
        )
    if not all(same_device(d, device) for d in a["diag_devices"]):
        failures.append(f"layer_diagnostics on {a['diag_devices']}")
    if not a["sampled_finite"]:
        failures.append("sampled logits not finite")
    res = {"prior_scale_rows": {"dev": a["rows"], "cpu": b["rows"]}, "logits": le, "parts": pe, "grads": ge}
    summary = (f"prior factor rel {fmt(factor)}, logits {fmt(le['norm'])}, parts {fmt(worst(pe)[1])}, "
               f"grad {fmt(gv)}; parts {sorted(b['parts'])}")  # fmt: skip
    return verdict(res, summary, failures, cut=None)


def frozen_trunk(device: str) -> dict:
    """``HFClassifier(frozen_trunk=True)``: a forward of the trunk's output equals a forward of the tokens."""
    transformers = need_transformers()
    import gpattn
    from gpattn.integrations.huggingface import HFClassifier

    ids = torch.tensor(TOKENS).to(device)
    pad = ids == 0
    model = HFClassifier(tiny_encoder(transformers), 2, "sgpa", "last", frozen_trunk=True).to(device).eval()
    h = model.trunk(ids, pad)
    with torch.no_grad(), gpattn.deterministic():
        a = model(h, pad, num_samples=2)
        b = model(ids, pad, num_samples=2)
    e = err(a, b)
    ok = e["norm"] < 1e-5 and same_device(h.device, device)
    return {
        "trunk_device": str(h.device),
        "err": e,
        "status": "pass" if ok else "fail",
        "summary": f"forward(trunk(ids)) vs forward(ids): {fmt(e['norm'])}; trunk on {h.device}",
    }


def _encoder_folder(transformers, work: Path) -> tuple[Path, Path]:
    """(a generated text table, a folder with a tiny BERT and a tokenizer of the table's words)."""
    from gpattn.experiments.data.fixtures import make_text_table, write_table_tokenizer

    table = make_text_table(work / "data" / "train.tsv", n=60, seed=0)
    enc = work / "enc"
    if not (enc / "config.json").is_file():
        vocab_size = write_table_tokenizer(table, enc)
        tiny_encoder(  # BERT's default dropouts: the runs train with them
            transformers, vocab_size, 40, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1
        ).save_pretrained(enc)
    return table, enc


def encoder_run(device: str, out: Path, recipe: str) -> dict:
    """``gpattn train --encoder`` (sgpa on the last layer) on the device, then ``load_run(...).predict``."""
    transformers = need_transformers()
    require("tokenizers", *TRAINING)
    import gpattn

    work = out / "runs" / "encoder"
    table, enc = _encoder_folder(transformers, work)
    folder = work / f"run-{recipe}"
    argv = ["train", "--dataset", "text_table", "--dataset-option", f"path={table}", "--encoder", str(enc),
            "--encoder-recipe", recipe, "--attention", "sgpa", "--attention-layers", "last", "--max-len", "12",
            "--epochs", "1", "--batch-size", "16", "--num-samples", "2", "--no-progress", "--device", device,
            "--out", str(folder)]  # fmt: skip
    rc, text = cli(argv, out / "logs" / "hf_cli.log")
    if rc != 0:
        return {"rc": rc, "status": "fail", "summary": f"exit {rc}: {text[-300:]}"}
    sub = metrics_subset(folder / "metrics.json")
    run = gpattn.experiments.load_run(folder, device=device)
    pl = placement(run.model, device)
    pred = run.predict(["a great film , really good", "terrible"], num_samples=3)
    fin = bool(torch.isfinite(pred.probs).all())
    ok = fin and finite_metrics(sub) and not off_device(pl)
    return {
        "metrics": sub,
        "placement": pl,
        "probs": pred.probs,
        "status": "pass" if ok else "fail",
        "summary": f"in_domain acc {fmt(sub.get('in_domain', {}).get('accuracy'), '.3f')}, "
        f"predict finite {fin}, model on {device}: {not pl['params_off_device']}",
    }


def check_hf(rec: Recorder, device: str, args) -> None:
    for attention, impl in SWAPS:
        rec.item(f"BERT swap {attention} ({impl}) step", lambda a=attention, i=impl: swap_step(device, a, i), need_s=3)
    for attention in ("sgpa", "kep-svgp"):
        rec.item(f"BERT swap {attention} bf16 autocast step", lambda a=attention: bf16_step(device, a), need_s=3)
    rec.item("HFClassifier sgpa: match_prior_to_stream + step", lambda: classifier(device), need_s=3)
    rec.item("HFClassifier frozen trunk on the device", lambda: frozen_trunk(device), need_s=3)
    for recipe in ("full", "frozen-trunk"):
        rec.item(
            f"gpattn train --encoder ({recipe}) + load_run.predict",
            lambda r=recipe: encoder_run(device, Path(args.out), r),
            need_s=8,
        )

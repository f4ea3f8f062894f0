"""Check ``train``: ``gpattn train`` / ``--resume`` / ``evaluate`` / ``load_run().predict`` on the device, the
host-device synchronisations of a training step, and a world-size-1 ``DistributedDataParallel`` step."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .compare import cuda_index, err, off_device, placement
from .record import Recorder, Skip, fmt, now, require, tail, verdict
from .sync import sync_events

#: what the digits runs train with (the runs are tiny: one epoch of a one-layer model)
DIGITS_ARGS = (
    "--dataset digits --no-progress --epochs 1 --batch-size 32 --embed-dim 32 --num-heads 2 --num-layers 1 "
    "--num-samples 4 --lr 3e-3 --seed 0"
).split()
#: the packages a training run needs
TRAINING = ("sklearn", "scipy", "tqdm", "gpattn.experiments.training")

KEY_METRICS = {
    "in_domain": ("accuracy", "nll", "ece", "mcc"),
    "shift": ("accuracy", "nll", "ece"),
    "ood": ("ood_auroc",),
}


def cli(argv: list, log: Path) -> tuple[int, str]:
    """``gpattn <argv>`` in this process, its output appended to ``log``; (exit code, output tail)."""
    from gpattn.experiments.cli import main as cli_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rc = cli_main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # noqa: BLE001 - the CLI should turn errors into exit codes; record if it does not
            buf.write(traceback.format_exc())
            rc = 99
    text = buf.getvalue()
    with open(log, "a") as fh:
        fh.write(f"\n$ gpattn {' '.join(argv)}\n{text}\n[exit {rc}]\n")
    return int(rc or 0), tail(text, 8)


def metrics_subset(path: Path) -> dict:
    """The :data:`KEY_METRICS` of a run's ``metrics.json``."""
    m = json.loads(path.read_text())
    return {s: {k: m.get(s, {}).get(k) for k in ks} for s, ks in KEY_METRICS.items() if s in m}


def finite_metrics(sub: dict) -> bool:
    vals = [v for s in sub.values() for v in s.values()]
    return bool(vals) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals)


@dataclass
class TrainCheck:
    """The check's device, its folders, and the finished runs by (attention, device, precision)."""

    device: str
    out: Path
    log: Path
    runs: dict = field(default_factory=dict)

    def run(self, attention: str, dev: str, precision: str, extra=()) -> dict:
        """One ``gpattn train`` run on the digits data: finite metrics, accuracy in [0, 1]."""
        require(*TRAINING)
        tag = "".join(f"-{e.strip('-')}" for e in extra)
        folder = self.out / f"{attention}-{precision}{tag}-{dev.replace(':', '')}"
        argv = ["train", *DIGITS_ARGS, "--attention", attention, "--device", dev, "--precision", precision, *extra]
        t0 = now()
        rc, text = cli([*argv, "--out", str(folder)], self.log)
        wall = now() - t0
        res = {"rc": rc, "train_wall_s": round(wall, 1), "folder": str(folder)}
        if rc != 0:
            return {**res, "status": "fail", "summary": f"exit {rc}: {text[-300:]}"}
        sub = metrics_subset(folder / "metrics.json")
        hist = json.loads((folder / "history.json").read_text())
        cfg = json.loads((folder / "config.json").read_text())
        res.update(metrics=sub, last_epoch=hist[-1] if hist else None, config_device=cfg.get("device"),
                   config_precision=cfg.get("precision"))  # fmt: skip
        if not extra:
            self.runs[(attention, dev, precision)] = res
        ok = finite_metrics(sub) and 0 <= (sub["in_domain"]["accuracy"] or -1) <= 1
        ind = sub.get("in_domain", {})
        loss = (hist[-1].get("train") or {}).get("loss") if hist else None
        return {
            **res,
            "status": "pass" if ok else "fail",
            "summary": f"{wall:.0f} s; in_domain acc {fmt(ind.get('accuracy'), '.3f')} "
            f"nll {fmt(ind.get('nll'), '.3f')} ece {fmt(ind.get('ece'), '.3f')}; train loss {fmt(loss, '.3f')}",
        }

    def resume(self) -> dict:
        """An interrupted run resumed on the device ends where the uninterrupted one does (CUDA RNG state)."""
        require(*TRAINING)
        from gpattn.experiments.data import load_dataset
        from gpattn.experiments.training import TrainConfig, train

        cfg = TrainConfig(dataset="digits", attention="sgpa", embed_dim=16, num_heads=2, num_layers=1, epochs=2,
                          batch_size=64, num_samples=2, progress=False, device=self.device)  # fmt: skip
        bundle = load_dataset("digits", seed=0)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            whole = train(cfg, self.out / "resume-whole", bundle=bundle)
            try:
                train(cfg, self.out / "resume-cut", bundle=bundle, stop_after_steps=5)
                raise AssertionError("stop_after_steps=5 did not interrupt the run")
            except KeyboardInterrupt:
                pass
            resumed = train(cfg, self.out / "resume-cut", resume=True, bundle=bundle)
        diffs = [
            abs(resumed[s][k] - whole[s][k])
            for s in whole
            if isinstance(whole[s], dict)
            for k in whole[s]
            if isinstance(whole[s].get(k), float) and isinstance(resumed.get(s, {}).get(k), float)
        ]
        worst = max(diffs, default=math.inf)
        status = "pass" if worst == 0.0 else "warn" if worst < 1e-5 else "fail"
        return {"max_abs_metric_diff": worst, "status": status,
                "summary": f"2 epochs, cut after 5 steps and resumed on {self.device}: max |Δmetric| {fmt(worst)} "
                           f"(0 = bit-exact)"}  # fmt: skip

    def _difference(self, a: dict, b: dict) -> dict:
        """``a``'s metrics minus ``b``'s, per split and metric (None where either is missing)."""
        ma, mb = a["metrics"], b["metrics"]
        return {
            s: {k: None if ma[s][k] is None or mb[s][k] is None else ma[s][k] - mb[s][k] for k in ma[s]}
            for s in ma
            if s in mb
        }

    def compare_runs(self) -> dict:
        """The device's runs against the CPU's, and sgpa in bf16 against fp32 (rough: warnings only)."""
        rows, warns = {}, []
        for attention in ("sgpa", "softmax"):
            a, b = self.runs.get((attention, self.device, "fp32")), self.runs.get((attention, "cpu", "fp32"))
            if a is None or b is None:
                continue
            d = rows[attention] = self._difference(a, b)
            acc, nll = d.get("in_domain", {}).get("accuracy"), d.get("in_domain", {}).get("nll")
            if acc is not None and (abs(acc) > 0.15 or abs(nll) > 0.5):
                warns.append(f"{attention}: {self.device} vs cpu differ by acc {acc:+.3f}, nll {nll:+.3f}")
        bf, fp = self.runs.get(("sgpa", self.device, "bf16")), self.runs.get(("sgpa", self.device, "fp32"))
        if bf and fp:
            d = self._difference(bf, fp)["in_domain"]
            rows["sgpa bf16 - fp32"] = {"in_domain": {k: d[k] for k in ("accuracy", "nll")}}
        if not rows:
            raise Skip("no pair of finished runs to compare")
        summ = "; ".join(
            f"{k}: Δacc {fmt(v.get('in_domain', {}).get('accuracy'), '+.3f')} "
            f"Δnll {fmt(v.get('in_domain', {}).get('nll'), '+.3f')}"
            for k, v in rows.items()
        )
        if self.device == "cpu":
            summ = "(device is cpu: each run is its own reference) " + summ
        return {"differences": rows, "warnings": warns, "status": "warn" if warns else "pass", "summary": summ}

    def evaluate(self) -> dict:
        """``gpattn evaluate`` of the device's softmax checkpoint on the device and on the CPU."""
        run = self.runs.get(("softmax", self.device, "fp32"))
        if run is None:
            raise Skip("the softmax run did not finish")
        res, failures = {}, []
        for dev in dict.fromkeys([self.device, "cpu"]):
            eo = self.out / f"eval-softmax-{dev.replace(':', '')}"
            argv = ["evaluate", "--checkpoint", str(Path(run["folder"]) / "checkpoint.pt"), "--device", dev]
            rc, text = cli([*argv, "--out", str(eo)], self.log)
            if rc != 0:
                failures.append(f"evaluate on {dev}: exit {rc}: {text[-200:]}")
                continue
            sub = metrics_subset(eo / "metrics.json")
            diff = {s: {k: abs(sub[s][k] - run["metrics"][s][k]) for k in sub[s] if sub[s][k] is not None} for s in sub}
            worst = max((v for s in diff.values() for v in s.values()), default=0.0)
            res[dev] = {"metrics": sub, "max_abs_diff_to_train_metrics": worst}
            # softmax in eval mode is deterministic: the same device reproduces the metrics; the CPU nearly
            if worst > (1e-6 if dev == self.device else 5e-3):
                failures.append(f"evaluate on {dev}: metrics differ from the run's by {worst:.1e}")
        summary = "; ".join(f"on {d}: max |Δmetric| {fmt(v['max_abs_diff_to_train_metrics'])}" for d, v in res.items())
        return verdict(res, summary, failures, cut=None)

    def load_and_predict(self) -> dict:
        """``load_run`` on the device and on the CPU: placement, deterministic ``predict`` alike on both."""
        import gpattn
        from gpattn.experiments.data import load_dataset

        run = self.runs.get(("sgpa", self.device, "fp32"))
        if run is None:
            raise Skip("the sgpa run did not finish")
        images = load_dataset("digits", seed=0).splits["test"].inputs[:96]
        res, failures = {}, []
        dev_run = gpattn.experiments.load_run(run["folder"], device=self.device)
        cpu_run = gpattn.experiments.load_run(run["folder"], device="cpu")
        res["placement"] = placement(dev_run.model, self.device)
        if off_device(res["placement"]):
            failures.append(f"load_run(device={self.device}) left tensors elsewhere: {res['placement']}")
        with gpattn.deterministic():
            pd = dev_run.predict(images, num_samples=2)
            pc = cpu_run.predict(images, num_samples=2)
        res["deterministic_probs_dev_vs_cpu"] = e = err(pd.probs, pc.probs)
        res["labels_agree"] = sum(a == b for a, b in zip(pd.labels, pc.labels)) / len(pd.labels)
        if e["max_abs"] > 1e-3:
            failures.append(f"deterministic predict differs between {self.device} and cpu: {e}")
        fin = self._sampled_predict(dev_run, images, res, failures)
        preds = torch.load(Path(run["folder"]) / "predictions.pt", weights_only=True)
        res["predictions_pt_devices"] = sorted({str(v["logits"].device) for v in preds.values()})
        summary = (f"deterministic probs {self.device} vs cpu max abs {fmt(e['max_abs'])}, "
                   f"labels agree {res['labels_agree']:.3f}; sampled finite {fin}")  # fmt: skip
        return verdict(res, summary, failures)

    @staticmethod
    def _sampled_predict(run, images, res: dict, failures: list) -> bool:
        """A sampled ``predict`` (8 draws): finite, probabilities summing to one. Whether it was finite."""
        torch.manual_seed(0)
        ps = run.predict(images, num_samples=8)
        fin = all(bool(torch.isfinite(t).all()) for t in (ps.probs, ps.total_entropy, ps.mutual_information))
        sums = float((ps.probs.sum(1) - 1).abs().max())
        res["sampled"] = {
            "finite": fin,
            "max_abs_probs_sum_minus_1": sums,
            "mean_mutual_information": float(ps.mutual_information.mean()),
        }
        if not fin or sums > 1e-4:
            failures.append(f"sampled predict: finite {fin}, |sum p - 1| {sums:.1e}")
        return fin


def model_and_batch(attention: str, device: str):
    """(config, digits bundle, model) of a small digits classifier, seeded."""
    require(*TRAINING)
    from gpattn.experiments.data import load_dataset
    from gpattn.experiments.training import TrainConfig, build_model

    cfg = TrainConfig(dataset="digits", attention=attention, embed_dim=32, num_heads=2, num_layers=1, batch_size=32,
                      num_samples=2, progress=False, device=device)  # fmt: skip
    bundle = load_dataset("digits", seed=0)
    torch.manual_seed(0)
    return cfg, bundle, build_model(cfg, bundle)


def _step_syncs(attention: str, device: str) -> dict:
    """The synchronisations of the trainer's third step (after two warm-up steps) of one model."""
    from gpattn.experiments.diagnostics import EpochStats
    from gpattn.experiments.training import _batch, _Dist, _DivergenceGuard, _train_step
    from gpattn.objectives import DeepGPELBO

    cfg, bundle, model = model_and_batch(attention, device)
    model = model.to(device)
    split = bundle.splits["train"]
    dist = _Dist(device)
    objective = DeepGPELBO(model, len(split.labels), combine_terms=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    guard, stats = _DivergenceGuard(model, dist.device), EpochStats()

    def step(i):
        idx = torch.arange(i * 32, (i + 1) * 32)
        _train_step(model, model, objective, optimizer, guard, stats, split, idx, i, cfg, dist)

    def forward():
        model.train()
        x, mask, y = _batch(split, torch.arange(32), device)
        return objective(model(x, mask, num_samples=1), y, step=0)["loss"]

    step(0)
    step(1)
    return sync_events(lambda: step(2), device, forward)


def train_step_sync(device: str) -> dict:
    """Host-device synchronisations of one training step of the trainer, sgpa and softmax (warnings)."""
    require(*TRAINING)
    from gpattn.experiments.training import _batch, _Dist, _DivergenceGuard, _train_step  # noqa: F401

    # ^ the trainer's private step: imported first, so that a CPU run sees it renamed or gone
    if torch.device(device).type != "cuda":
        raise Skip("CPU device: no host-device synchronisation to watch")
    res = {attention: _step_syncs(attention, device) for attention in ("sgpa", "softmax")}
    counts = {k: v.get("count", 0) for k, v in res.items()}
    res["status"] = "warn" if any(counts.values()) else "pass"
    res["summary"] = "; ".join(
        f"{k}: {c} sync(s)" + (f" at {list(res[k]['by_location'])[:3]}" if c else "") for k, c in counts.items()
    )
    return res


def _three_steps(net, inner, x, y, num_data: int) -> torch.Tensor:
    """The losses of three Adam steps of ``net`` (whose parameters are ``inner``'s), seeded."""
    from gpattn.objectives import DeepGPELBO

    objective = DeepGPELBO(inner, num_data, combine_terms=False)
    opt = torch.optim.Adam(inner.parameters(), lr=1e-3)
    torch.manual_seed(5)
    vals = []
    for _ in range(3):
        opt.zero_grad()
        parts = objective(net(x, None, num_samples=2), y)
        parts["loss"].backward()
        opt.step()
        vals.append(parts["loss"].detach())
    return torch.stack(vals)


def _process_group(device: str) -> str:
    """A world-size-1 process group (NCCL on CUDA, else gloo) over an in-process store; its backend. (A free port
    found by binding port 0 and passed to ``tcp://`` is free only until the socket closes: once, in CI, the group's
    initialisation then hung until the check's limit.)"""
    import torch.distributed as tdist

    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl" and not tdist.is_nccl_available():
        raise Skip("NCCL is not available in this torch build")
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(cuda_index(device))
    tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1)
    return backend


def ddp_world1(device: str) -> dict:
    """Three Adam steps through ``DistributedDataParallel`` (world size 1) equal those of the plain model."""
    import torch.distributed as tdist

    if not tdist.is_available():
        raise Skip("torch.distributed is not available")
    _, bundle, model = model_and_batch("sgpa", device)
    split = bundle.splits["train"]
    x, y = split.inputs[:32].to(device), split.labels[:32].to(device)
    plain = model.to(device)
    wrapped_model = copy.deepcopy(plain)
    backend = _process_group(device)
    try:
        ids = [cuda_index(device)] if backend == "nccl" else None
        ddp = torch.nn.parallel.DistributedDataParallel(wrapped_model, device_ids=ids, static_graph=True)
        losses = {label: _three_steps(net, inner, x, y, len(split.labels))
                  for label, net, inner in (("plain", plain, plain), ("ddp", ddp, wrapped_model))}  # fmt: skip
        params = err(
            torch.cat([p.detach().flatten() for p in wrapped_model.parameters()]),
            torch.cat([p.detach().flatten() for p in plain.parameters()]),
        )
    finally:
        tdist.destroy_process_group()
    le = err(losses["ddp"], losses["plain"])
    ok = le["norm"] < 1e-4 and params["norm"] < 1e-4 and bool(torch.isfinite(losses["ddp"]).all())
    return {"backend": backend, "losses": losses, "loss_err": le, "param_err": params,
            "status": "pass" if ok else "fail",
            "summary": f"{backend}, 3 Adam steps: losses {fmt(le['norm'])}, parameters {fmt(params['norm'])} "
                       f"(normalised, DDP vs plain)"}  # fmt: skip


def check_train(rec: Recorder, device: str, args) -> None:
    out = Path(args.out) / "runs"
    out.mkdir(parents=True, exist_ok=True)
    ctx = TrainCheck(device, out, Path(args.out) / "logs" / "train_cli.log")
    specs = [("sgpa", device, "fp32"), ("softmax", device, "fp32"), ("sgpa", device, "bf16")]
    if device != "cpu":
        specs += [("sgpa", "cpu", "fp32"), ("softmax", "cpu", "fp32")]
    for attention, dev, precision in specs:
        rec.item(f"train {attention} {precision} on {dev}", lambda s=(attention, dev, precision): ctx.run(*s),
                 need_s=10)  # fmt: skip
    # value checks on: host reads of NaN inputs, labels, Cholesky failures with jitter escalation, per step
    rec.item(f"train sgpa fp32 --validate on {device}", lambda: ctx.run("sgpa", device, "fp32", ("--validate",)))
    rec.item(f"--resume on {device} (cut after 5 steps)", ctx.resume, need_s=10)
    rec.item(f"metrics {device} vs cpu (rough)", ctx.compare_runs)
    rec.item("gpattn evaluate (device, cpu)", ctx.evaluate, need_s=5)
    rec.item("load_run + predict", ctx.load_and_predict, need_s=5)
    rec.item("training step: host-device synchronisations", lambda: train_step_sync(device), need_s=10)
    rec.item("DistributedDataParallel, world size 1", lambda: ddp_world1(device), need_s=10)

"""What a run will cost, said before it costs it: ``gpattn train`` and ``gpattn compare`` time a run's first steps
(the first, warm-up, step excluded) and one evaluation pass, then print the run's estimated time (training and
evaluation) and, in ``compare``, "run k of n" and the time left; a configuration expected to take over an hour on
this machine gets a warning line.

The time left counts every later run at its variant's measured time once one of its runs is timed; before that, at
its *prior*: ``compare`` times the first steps and one evaluation pass of every variant of its plan up front
(``gpattn.experiments.compare.probe_runs``, the same measurement a run makes of itself, a few seconds in all),
and an untimed variant counts at its prior times the ratio of the timed variants' times to their priors (what the
short probe does not see: building the model, the detectors, the files, the machine's load). The report's plots
count at :data:`SECONDS_PER_FIGURE` each.

The arithmetic is pure (:func:`run_estimate`, :func:`time_left`, :func:`duration`), tested on constructed timings;
:class:`StepClock` holds the measurement, :class:`RunPlan` ``compare``'s runs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence

#: steps left untimed at a run's start (the first call's one-off work: imports, allocations, compilation)
WARM_UP_STEPS = 1
#: steps timed after the warm-up for the time per step
TIMED_STEPS = 3
#: an estimate over this many seconds gets a warning line before the run goes on
WARN_SECONDS = 3600.0
#: seconds per figure of ``compare``'s report (PNG, Agg), its tables included: ``make demo`` at fdc5f1e wrote 50
#: figures and report.md in 14.9 s on 2 CPU cores (docs/benchmarks.md)
SECONDS_PER_FIGURE = 0.3


@dataclasses.dataclass(frozen=True)
class RunEstimate:
    """A run's expected seconds: ``training`` (its steps left) and ``evaluation`` (its rows × samples), with what
    they were estimated from."""

    training: float
    evaluation: float
    steps: int
    seconds_per_step: float
    row_samples: int

    @property
    def total(self) -> float:
        """Training and evaluation, in seconds."""
        return self.training + self.evaluation

    def line(self) -> str:
        """``~4.2 min (training: 120 steps at 1.52 s/step, ~3.0 min; evaluation: 3,700 row-samples, ~1.2 min)``."""
        return (f"{duration(self.total)} (training: {self.steps} steps at {self.seconds_per_step:.3g} s/step, "
                f"{duration(self.training)}; evaluation: {self.row_samples:,} rows × samples, "
                f"{duration(self.evaluation)})")


def run_estimate(steps: int, seconds_per_step: float, row_samples: int, seconds_per_row_sample: float) -> RunEstimate:
    """The seconds of ``steps`` optimizer steps at ``seconds_per_step`` and of an evaluation of ``row_samples`` rows ×
    samples at ``seconds_per_row_sample`` (measured on one evaluation pass)."""
    for name, value in (("steps", steps), ("row_samples", row_samples)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    for name, value in (("seconds_per_step", seconds_per_step), ("seconds_per_row_sample", seconds_per_row_sample)):
        if not value >= 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return RunEstimate(steps * seconds_per_step, row_samples * seconds_per_row_sample, steps, seconds_per_step,
                       row_samples)


def time_left(current_left: float, later: Sequence[Hashable], known: dict, prior: dict | None = None,
              extra: float = 0.0) -> tuple[float, int]:
    """(seconds, runs guessed): the current run's ``current_left`` seconds, ``extra`` (e.g. the report's) and every
    ``later`` run's: the ``known`` seconds of its key (a variant timed already), else (counted in the second value)
    its ``prior`` seconds times the calibration ratio Σ known / Σ prior over the keys that have both (1 when none
    has), else the mean of the known ones. A key of ``None`` is a run that costs nothing (reused)."""
    prior = prior or {}
    mean = sum(known.values()) / len(known) if known else 0.0
    both = [key for key in known if key in prior]
    denominator = sum(prior[key] for key in both)
    ratio = sum(known[key] for key in both) / denominator if both and denominator > 0 else 1.0

    def guess(key) -> float:
        return prior[key] * ratio if key in prior else mean

    guessed = sum(1 for key in later if key is not None and key not in known)
    return current_left + extra + sum(known[key] if key in known else guess(key) for key in later
                                      if key is not None), guessed


def report_seconds(figures: int) -> float:
    """The seconds ``compare``'s report of ``figures`` figures takes, at :data:`SECONDS_PER_FIGURE` each."""
    if isinstance(figures, bool) or not isinstance(figures, int) or figures < 0:
        raise ValueError(f"figures must be an int >= 0, got {figures!r}")
    return figures * SECONDS_PER_FIGURE


def duration(seconds: float) -> str:
    """``~40 s``, ``~4.2 min``, ``~2.3 h``."""
    if seconds < 90:
        return f"~{seconds:.0f} s"
    if seconds < 5400:
        return f"~{seconds / 60:.1f} min"
    return f"~{seconds / 3600:.1f} h"


def over_an_hour(seconds: float, what: str) -> str | None:
    """The warning line for an estimate over :data:`WARN_SECONDS`, else None."""
    if seconds <= WARN_SECONDS:
        return None
    return (f"warning: {what} is expected to take {duration(seconds)} on this machine; fewer epochs, seeds or "
            f"variants, a shorter max_len or fewer --num-samples shorten it (interrupt with Ctrl-C: a run resumes "
            f"from its checkpoint)")


class StepClock:
    """Times the steps of one process's run: ``tick()`` after every step returns the mean seconds per step of
    the :data:`TIMED_STEPS` steps after the :data:`WARM_UP_STEPS` first, once, then None. ``sync``: what makes the
    device's queued work finish (CUDA) before a reading."""

    def __init__(self, sync: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter):
        self.sync, self.clock, self.steps, self.start, self.done = sync, clock, 0, None, False

    def tick(self) -> float | None:
        """Count a step; the mean seconds per timed step once they are done (once), else None."""
        if self.done:
            return None
        self.steps += 1
        if self.steps == WARM_UP_STEPS:
            self.sync()
            self.start = self.clock()
        elif self.steps == WARM_UP_STEPS + TIMED_STEPS:
            self.sync()
            self.done = True
            return (self.clock() - self.start) / TIMED_STEPS
        return None


class RunPlan:
    """``compare``'s runs in order (their folders; a run finished on disk counts as reused, no cost), each announced
    as "run k of n", its estimate and the time left when its first steps are timed, its time when it ends.
    ``prior``: each key's (variant folder's) seconds measured up front, for the variants not timed yet
    (:func:`time_left`); ``report``: the seconds the report will take after the last run."""

    def __init__(self, folders: Sequence, log: Callable[[str], None], finished: Callable[[object], bool]):
        self.folders = list(dict.fromkeys(folders))  # one run per folder (+ts shares its variant's)
        self.keys = {f: None if finished(f) else f.parent for f in self.folders}  # a variant's seeds cost alike
        self.log, self.known, self.started, self.warned = log, {}, {}, False
        self.began = time.perf_counter()
        # per finished run: its time beyond its estimate (building the model, post-hoc fits, detectors, the saved
        # files), which a run's steps and evaluation pass do not time; their mean is added to later estimates
        self.estimates: dict = {}
        self.overheads: list[float] = []
        self.prior: dict = {}
        self.report = 0.0

    @property
    def overhead(self) -> float:
        """The mean seconds a finished run took beyond its estimate (0 before any has finished)."""
        return sum(self.overheads) / len(self.overheads) if self.overheads else 0.0

    def _tag(self, folder, label: str) -> str:
        return f"[compare] run {self.folders.index(folder) + 1} of {len(self.folders)} ({label})"

    def start(self, folder, label: str) -> None:
        """Announce the run in ``folder`` ("run k of n (label): started") and start its clock."""
        self.started[folder] = time.perf_counter()
        self.log(f"{self._tag(folder, label)}: started")

    def estimated(self, folder, label: str) -> Callable[[RunEstimate], None]:
        """The callback ``train`` gives the run's estimate: the run's line, the time left, a warning over an hour."""

        def report(estimate: RunEstimate) -> None:
            self.estimates[folder] = estimate.total
            current = estimate.total + self.overhead
            self.known.setdefault(self.keys[folder], current)
            later = [self.keys[f] for f in self.folders[self.folders.index(folder) + 1 :]]
            left, guessed = time_left(current, later, self.known, self.prior, self.report)
            runs = "1 run" if guessed == 1 else f"{guessed} runs"
            how = "their first steps' time" if self.prior else "the mean"
            note = f" ({runs} of variants not timed yet counted at {how})" if guessed else ""
            note += f" (the report ~{self.report:.0f} s included)" if self.report else ""
            self.log(f"{self._tag(folder, label)}: {estimate.line()}; {duration(left)} left in this compare{note}")
            warning = over_an_hour(time.perf_counter() - self.began + left, "this compare")
            if warning and not self.warned:
                self.warned = True
                self.log(f"[compare] {warning}")

        return report

    def finish(self, folder, label: str, reused: bool) -> None:
        """Say the run took its time (which then stands for its variant's other seeds), or that it was finished
        before (``reused``)."""
        if reused:
            self.log(f"{self._tag(folder, label)}: done before, nothing to run")
            return
        took = time.perf_counter() - self.started.get(folder, time.perf_counter())
        if self.keys.get(folder) is not None:
            self.known[self.keys[folder]] = took  # the measured time replaces the estimate for its other seeds
        if folder in self.estimates:
            self.overheads.append(max(took - self.estimates.pop(folder), 0.0))
        self.log(f"{self._tag(folder, label)}: done in {duration(took)[1:]}")

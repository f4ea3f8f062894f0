"""The checks of ``benchmarks/gpu_check.py`` (the CUDA paths end to end against the CPU), by concern.

- :mod:`.record`: a check's items (:class:`~.record.Recorder`), JSON output and small helpers;
- :mod:`.compare`: differences of device results against CPU references, tolerances, placement;
- :mod:`.sync`: host-device synchronisations under torch's CUDA sync debug mode;
- :mod:`.layers`, :mod:`.train`, :mod:`.hf`, :mod:`.timing`: the four checks;
- :mod:`.runner`: each check in its own child process, the summary, ``gpu_check.json`` / ``.md``.

``benchmarks/gpu_check.py`` is the command line; its docstring says what each check does.
"""

from pathlib import Path

#: this package, the benchmarks folder, the repository root, and the entry script (the children run it)
PKG = Path(__file__).resolve().parent
BENCH = PKG.parent
ROOT = BENCH.parent
SCRIPT = BENCH / "gpu_check.py"

"""Helpers shared by test_sgpa.py and test_sgpa_decoupled.py (not a test module: no ``test_`` prefix)."""

import importlib
import sys


def spy_iterative_solvers(monkeypatch):
    """Replace linear_operator's CG and Lanczos entry points, wherever they were imported, by spies.

    Returns the list the spies append the name of each called solver to (still calling the original), so a
    test can assert it stays empty: the exact (Cholesky) algebra ran throughout."""
    cg = importlib.import_module("linear_operator.utils.linear_cg")
    lanczos = importlib.import_module("linear_operator.utils.lanczos")
    calls = []
    originals = {"linear_cg": cg.linear_cg, "lanczos_tridiag": lanczos.lanczos_tridiag}
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if not name.startswith(("linear_operator", "gpytorch")):
            continue
        for attr, fn in originals.items():
            if vars(module).get(attr) is fn:

                def spy(*args, _fn=fn, _attr=attr, **kwargs):
                    calls.append(_attr)
                    return _fn(*args, **kwargs)

                monkeypatch.setattr(module, attr, spy)
    return calls

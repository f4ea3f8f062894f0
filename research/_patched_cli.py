"""The shared shape of the probes that are ``gpattn train`` with one function of the trainer replaced."""

from __future__ import annotations

import argparse

from gpattn.experiments import cli, training


def run_patched(argv, description: str, flag: str, kind: type, help: str, name: str, make):
    """Parse ``flag VALUE -- gpattn-command-line``, replace ``training.<name>`` by ``make(VALUE)`` while
    ``cli.main`` runs that command line, then restore it (also when it raises)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(flag, type=kind, required=True, help=help)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the gpattn command line (train ...)")
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    original = getattr(training, name)
    setattr(training, name, make(getattr(ns, flag.lstrip("-").replace("-", "_"))))
    try:
        return cli.main(args)
    finally:
        setattr(training, name, original)

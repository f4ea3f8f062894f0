"""``python -m gpattn`` (also the entry point for ``torchrun -m gpattn``)."""

import sys

try:
    from gpattn.experiments.cli import main
except ImportError as err:  # a folder named gpattn shadows the package (gpattn._shadow): its message, no traceback
    if "shadows the package" not in str(err):
        raise
    print(f"gpattn: error: {err}", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())

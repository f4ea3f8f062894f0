"""``python -m gpattn`` (also the entry point for ``torchrun -m gpattn``)."""

import sys

from gpattn.experiments.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""Imported first by the GPU benchmark scripts: this tree's ``src/`` goes first on ``sys.path``, so that a plain
``python3`` with nothing installed (the GPU machine has no virtual environment) benchmarks this tree's dls, and so
does one with another copy of dls installed."""

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if (SRC / "dls").is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

"""The repository root on ``sys.path``, so that these tests import the benchmarks' code
as the scripts do: ``from benchmarks.lib.<module> import ...``."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

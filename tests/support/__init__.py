"""Helpers the tests share: the repository root, joiner processes, worker-side fault
injection and staging, and the reference remap planner.

``tests/`` is on ``sys.path`` (pytest puts the root conftest's folder there, and the
local workers inherit the driver's path), so every test imports these as ``support.*``.
"""

from pathlib import Path

#: The repository's root folder.
ROOT = Path(__file__).resolve().parents[2]

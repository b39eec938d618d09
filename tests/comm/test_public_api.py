"""nereus_comm's public surface: every error it documents is exported, every exported
name is documented, and nobody reaches into its private members.

Private means a module or name that starts with ``_``. nereus_rl (and any other
framework) imports nereus_comm through public modules and names only; inside
nereus_comm a module imports no other module's private names (the native core,
``nereus_comm._C``, is the package's own and its modules may use it).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import test_layering  # tests/ is on sys.path (tests/conftest.py)
import torch

import nereus_comm
import nereus_comm.errors
import nereus_comm.testing

ROOT = Path(__file__).resolve().parents[2]


def _nereus_comm_imports(path: Path):
    """(line, module, name or None) of every import of nereus_comm in a file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "nereus_comm":
                    yield node.lineno, a.name, None
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] == "nereus_comm":
                for a in node.names:
                    yield node.lineno, node.module, a.name


def _private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def test_every_error_is_exported_from_the_package():
    errors = {
        name
        for name, obj in vars(nereus_comm.errors).items()
        if inspect.isclass(obj) and issubclass(obj, nereus_comm.NereusCommError)
    }
    assert errors <= set(nereus_comm.__all__), sorted(errors - set(nereus_comm.__all__))


def test_every_exported_name_resolves_and_is_documented():
    for module in (nereus_comm, nereus_comm.testing):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert inspect.getdoc(obj), f"{module.__name__}.{name} has no docstring"


def test_nereus_rl_uses_only_public_nereus_comm():
    bad = []
    for path in sorted((ROOT / "nereus_rl").rglob("*.py")):
        for line, module, name in _nereus_comm_imports(path):
            if _private(module) or (name is not None and name.startswith("_")):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} {name or ''}")
    assert not bad, "nereus_rl reaches into nereus_comm's private members:\n" + "\n".join(bad)


def test_no_private_cross_imports_inside_nereus_comm():
    bad = []
    for path in sorted((ROOT / "nereus_comm").rglob("*.py")):
        for line, module, name in _nereus_comm_imports(path):
            if module == "nereus_comm" and name == "_C":
                continue
            if _private(module) or (name is not None and name.startswith("_")):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {module} {name or ''}")
    assert not bad, "private cross-imports inside nereus_comm:\n" + "\n".join(bad)


def test_nereus_comm_has_no_import_cycle():
    graph = test_layering.import_graph()
    cycle = test_layering.find_cycle(
        {m: d for m, d in graph.items() if m.startswith("nereus_comm")}
    )
    assert cycle is None, " -> ".join(cycle or [])


def test_prepare_reshard_derives_the_program_reshard_uses():
    from nereus_comm import reshard_program

    specs = [nereus_comm.TensorSpec("w", (8, 4), torch.float32, split_dim=0)]
    plan = nereus_comm.plan_reshard(
        specs, nereus_comm.Layout(2, 1, 1, (0, 1)), nereus_comm.Layout(1, 2, 1, (0, 1))
    )
    assert plan not in reshard_program._PROGRAMS
    nereus_comm.prepare_reshard(plan, 1, direct_min_bytes=1)
    kept = reshard_program._PROGRAMS[plan][(1, 1)]
    assert reshard_program.program(plan, 1, 1) is kept  # what reshard finds: not rebuilt
    with pytest.raises(nereus_comm.PlanError, match="plan_reshard"):
        nereus_comm.prepare_reshard("not a plan", 0)

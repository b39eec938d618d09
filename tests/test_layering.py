"""The package's import structure: no cycles, and dependencies that point one way.

Every import counts, at any depth of the file: module level, inside functions, and
under ``if TYPE_CHECKING:``. A module's implicit import of its parent packages does
not (Python runs a package's ``__init__`` before any submodule, so counting it would
make every package a cycle with its own members).

The allowed directions are the architecture's (README, "Module map"): the decision
layer (core, costmodel, planner, policy, transition) is pure computation and never
reaches the processes (runtime, emu), the model code or the trainer, and
nereus_comm never imports nereus_rl.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("nereus_comm", "nereus_rl")
# Compiled extensions have no .py file to find.
EXTENSIONS = {"nereus_comm._C", "nereus_rl._native"}

# nereus_rl's subpackages and the subpackages each may import (besides itself).
DECISION = {"core", "costmodel", "planner", "policy", "transition"}
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "costmodel": {"core"},
    "planner": {"core", "costmodel", "_native"},
    "policy": {"core", "costmodel", "planner", "transition"},
    "transition": {"core", "_native"},
    "baselines": {"core", "costmodel", "planner", "transition"},
    "runtime": set(),
    "algos": set(),
    "models": {"core"},
    "data": {"core", "models"},
    "emu": {"core", "costmodel", "transition", "runtime"},
    "trainer": {
        "core",
        "costmodel",
        "planner",
        "policy",
        "transition",
        "emu",
        "models",
        "data",
        "algos",
        "runtime",
    },
    "cli": {"trainer", "runtime", "core", "models", "data"},
    "": {"trainer"},  # nereus_rl/__init__.py
    "_native": set(),
}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the two packages."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        # os.walk follows links: nereus_comm/kernels is a link to kernels/.
        paths = (Path(d) / f for d, _, fs in os.walk(root / pkg, followlinks=True) for f in fs)
        for path in sorted(p for p in paths if p.suffix == ".py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(name: str, source: str, known: Iterable[str], is_package: bool = False) -> set[str]:
    """The known modules that ``source`` (the text of module ``name``) imports anywhere."""
    known = set(known)
    deps: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            # ``from pkg import sub`` imports the submodule when there is one.
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            targets = subs or [mod]
        else:
            continue
        for target in targets:
            # ``import a.b.c`` depends on a.b.c; walk up to the nearest known module.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
    return deps


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the two packages it imports."""
    files = module_files(root)
    known = set(files) | EXTENSIONS
    return {
        name: imports_of(name, path.read_text(), known, path.name == "__init__.py")
        for name, path in files.items()
    }


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def layer(module: str) -> str:
    """nereus_rl's subpackage that holds ``module`` ('' for the package itself)."""
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    return parts[1]


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_imports_count_function_level_and_type_checking():
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from p.a import X\n"
        "def f():\n    from p import b\n"
        "import p.c.d as e\n"
    )
    assert imports_of("p.z", src, {"p", "p.a", "p.b", "p.c"}) == {"p.a", "p.b", "p.c"}


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_nereus_comm_never_imports_nereus_rl():
    bad = {
        (m, d)
        for m, deps in import_graph().items()
        if m.startswith("nereus_comm")
        for d in deps
        if d.startswith("nereus_rl")
    }
    assert not bad, sorted(bad)


def test_nereus_rl_subpackages_depend_one_way():
    bad = []
    for module, deps in import_graph().items():
        if not module.startswith("nereus_rl"):
            continue
        here = layer(module)
        assert here in ALLOWED, f"{module}: subpackage {here!r} has no row in ALLOWED"
        for dep in deps:
            if not dep.startswith("nereus_rl"):
                continue
            there = layer(dep)
            if there != here and there not in ALLOWED[here]:
                bad.append(f"{module} -> {dep}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_the_decision_layer_is_allowed_only_pure_imports():
    for name in DECISION:
        assert not ALLOWED[name] & {"runtime", "emu", "models", "trainer", "data", "algos"}

"""The codebase keeps its shape: the import rule of docs/architecture.md, and small modules and functions.

Imports are read statically (every ``import`` and ``from ... import``, at any depth of a
module), and followed through kvpool's own modules, so an indirect path counts too.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "worker", "store")
EDGE = "gateway.cli"
"""The command line (every ``kvpool`` command, the process helpers, the benchmarks): it may start anything."""
ENGINE_SIDE = {
    "worker.engine",
    "worker.prefix",
    "worker.llama_state",
    "worker.kvchunks",
    "worker.process",
    "worker.publisher",
    "worker.selfcheck",
    "worker.leases",
    "gateway.cli.bench",
}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = path
    return out


MODULES = _modules()


@cache
def _direct_imports(name: str) -> frozenset[str]:
    tree = ast.parse(MODULES[name].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return frozenset(m for m in found if m in MODULES)


def _reachable(name: str) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        for m in _direct_imports(todo.pop()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _engine_side(module: str) -> bool:
    return any(module == e or module.startswith(e + ".") for e in ENGINE_SIDE)


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("gateway") and not _in(m, EDGE)])
def test_the_gateway_never_reaches_the_engine(name: str) -> None:
    bad = sorted(m for m in _reachable(name) if _engine_side(m))
    assert not bad, f"{name} imports the engine side: {bad}"


@pytest.mark.parametrize("name", [m for m in MODULES if not _in(m, EDGE)])
def test_the_library_never_reaches_the_command_line(name: str) -> None:
    """Starting processes, benchmarks and commands sit at the edge; the library packages work without them."""
    bad = sorted(m for m in _reachable(name) if _in(m, EDGE))
    assert not bad, f"{name} imports the command line: {bad}"


def test_processes_are_started_in_one_module() -> None:
    starters = sorted(n for n, p in MODULES.items() if "subprocess.Popen(" in p.read_text())
    assert starters == ["gateway.cli.procs"], starters


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("store")])
def test_the_store_imports_neither_gateway_nor_worker(name: str) -> None:
    bad = sorted(m for m in _reachable(name) if not m.startswith("store"))
    assert not bad, f"{name} imports {bad}"


def test_modules_stay_small() -> None:
    big = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    assert not {n: k for n, k in big.items() if k > MAX_MODULE_LINES}, f"modules over {MAX_MODULE_LINES} lines"


def test_functions_stay_small() -> None:
    long = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{name}.{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"

"""The codebase keeps its shape: the import rule of docs/architecture.md, no import cycles, and small modules and functions.

Imports are read statically (every ``import`` and ``from ... import``, at any depth of a
module, so lazy imports inside functions and ``TYPE_CHECKING`` blocks count), and followed
through kvpool's own modules, so an indirect path counts too.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "worker", "store")
ROOT_COMMAND = "gateway.cli"
"""The root ``kvpool`` command: it reaches every command group through a table of names, imported when used."""
POOL = "gateway.pool"
"""Running a whole pool (processes, ``kvpool up``, the generated docs, the benchmarks): it may import anything, nothing imports it."""
ENGINE_SIDE = {"worker.engine", "worker.cache", "worker.startup", "worker.answering", "worker.process"}
"""The worker's engine side: its four folders and the job's path through them (`worker.answering`)."""
WORKER_LAYERS = ["worker.engine", "worker.cache", "worker.startup", "worker.answering", "worker.process"]
"""The worker's parts from the ground up: each imports only those below it (docs/architecture.md's map)."""
MAX_MODULE_LINES = 400
ROOMY_MODULES = {"worker.engine.loop": 600}
"""Modules whose one concept needs more room than `MAX_MODULE_LINES` (the engine loop: its iteration, calls and their failures)."""
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


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("gateway") and not _in(m, POOL)])
def test_the_gateway_never_reaches_the_engine(name: str) -> None:
    bad = sorted(m for m in _reachable(name) if _engine_side(m))
    assert not bad, f"{name} imports the engine side: {bad}"


@pytest.mark.parametrize("name", [m for m in MODULES if any(_in(m, layer) for layer in WORKER_LAYERS)])
def test_each_part_of_the_worker_imports_only_the_parts_below_it(name: str) -> None:
    own = next(i for i, layer in enumerate(WORKER_LAYERS) if _in(name, layer))
    above = WORKER_LAYERS[own + 1 :]
    bad = sorted(m for m in _direct_imports(name) if any(_in(m, layer) for layer in above))
    assert not bad, f"{name} ({WORKER_LAYERS[own]}) imports the parts above it: {bad}"


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("gateway") and not _in(m, POOL)])
def test_the_gateway_never_imports_rq(name: str) -> None:
    """Queues, job records and statuses are `worker.client`'s business: the one module of the client side that uses RQ."""
    tree = ast.parse(MODULES[name].read_text())
    found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    found |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in found if m == "rq" or m.startswith("rq.")}, f"{name} imports rq"


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("gateway") and not _in(m, POOL)])
def test_the_gateway_reads_only_the_pool_settings(name: str) -> None:
    """From worker.settings the gateway takes `PoolSettings` (what it and the workers agree on), never the worker's own."""
    tree = ast.parse(MODULES[name].read_text())
    taken = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "worker.settings" for a in n.names}
    assert taken <= {"PoolSettings"}, f"{name} imports {sorted(taken)} from worker.settings"
    assert "WorkerSettings" not in MODULES[name].read_text(), f"{name} names WorkerSettings"


@pytest.mark.parametrize("name", [m for m in MODULES if not _in(m, POOL)])
def test_nothing_imports_the_pool_tools(name: str) -> None:
    """Starting processes, `kvpool up` and the benchmarks sit outside the library: a worker or gateway runs without them."""
    bad = sorted(m for m in _reachable(name) if _in(m, POOL))
    assert not bad, f"{name} imports {POOL}: {bad}"


def _is_command_module(name: str) -> bool:
    return name.endswith(".cli") and name != ROOT_COMMAND


@pytest.mark.parametrize("name", list(MODULES))
def test_command_modules_are_imported_only_by_the_root_command(name: str) -> None:
    bad = sorted(m for m in _direct_imports(name) if _is_command_module(m) and not _in(m, name))
    assert not bad, f"{name} imports command modules {bad}: only the root command's table names them"


def test_every_command_of_the_root_table_exists() -> None:
    from gateway.cli import _GROUPS

    for name, target in _GROUPS.items():
        module, _, attr = target.partition(":")
        assert module in MODULES, f"kvpool {name}: no module {module}"
        assert hasattr(importlib.import_module(module), attr), f"kvpool {name}: {module} has no {attr}"


def _cycles(imports: Callable[[str], frozenset[str]] = _direct_imports, modules: Iterable[str] = MODULES) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in imports(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in imports(v):
                found.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    return found


def test_there_is_no_import_cycle() -> None:
    assert not _cycles(), f"import cycles: {_cycles()}"


def test_the_cycle_check_sees_a_lazy_cycle() -> None:
    """The check itself, on two modules that import each other (one of them inside a function)."""
    sources = {"a": "import b\n", "b": "def f():\n    import a\n", "c": "import a\n"}
    graph = {
        m: frozenset(n.name for node in ast.walk(ast.parse(s)) if isinstance(node, ast.Import) for n in node.names)
        for m, s in sources.items()
    }
    assert _cycles(graph.__getitem__, graph) == [["a", "b"]]


def test_processes_are_started_in_one_module() -> None:
    starters = sorted(n for n, p in MODULES.items() if "subprocess.Popen(" in p.read_text())
    assert starters == ["gateway.pool.procs"], starters


@pytest.mark.parametrize("name", [m for m in MODULES if m.startswith("store")])
def test_the_store_imports_neither_gateway_nor_worker(name: str) -> None:
    bad = sorted(m for m in _reachable(name) if not m.startswith("store"))
    assert not bad, f"{name} imports {bad}"


def test_modules_stay_small() -> None:
    big = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()}
    over = {n: k for n, k in big.items() if k > ROOMY_MODULES.get(n, MAX_MODULE_LINES)}
    assert not over, f"modules over {MAX_MODULE_LINES} lines ({ROOMY_MODULES} where named)"


def test_functions_stay_small() -> None:
    long = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{name}.{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_tests_import_shared_helpers_from_tests_helpers_never_from_a_conftest() -> None:
    """Conftests hold fixtures, which pytest hands out by name; anything imported lives in tests/helpers.py."""
    bad = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "tests").rglob("*.py"))
        if "conftest import" in p.read_text() and p.name != "test_architecture.py"
    ]
    assert not bad, f"modules importing from a conftest: {bad}"

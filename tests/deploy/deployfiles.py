"""Readers for the files under deploy/, for the deploy tests (those the .env.example generator needs come from `gateway.pool.envfile`).

Nothing here runs Docker: the files are parsed and checked statically, against the code
(settings classes, metric registry, CLI) and against the tools' own validators
(the Compose Specification schema, promtool).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from gateway.pool import envfile
from gateway.settings import GatewaySettings
from worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PROMETHEUS_FILE = DEPLOY / "prometheus.yml"
GRAFANA = DEPLOY / "grafana"
DASHBOARDS = GRAFANA / "dashboards"

ENV_PREFIX = envfile.ENV_PREFIX
# What the .env.example generator reads, shared with these tests.
Instruction, Reference, Setting = envfile.Instruction, envfile.Reference, envfile.Setting
environment, parse_dockerfile, references, render_env_value = (
    envfile.environment,
    envfile.parse_dockerfile,
    envfile.references,
    envfile.render_env_value,
)
settings = envfile.settings
_INTERPOLATION = envfile._INTERPOLATION


# --------------------------------------------------------------------------- settings


class AllSettings(GatewaySettings, WorkerSettings):
    """Every kvpool setting at once: what the gateway and a worker, between them, read from one environment."""


# --------------------------------------------------------------------------- compose


def compose_text() -> str:
    return COMPOSE_FILE.read_text()


def compose_raw() -> dict[str, Any]:
    return yaml.safe_load(compose_text())


def interpolate_str(value: str, env: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("named")
        op, arg = m.group("op"), m.group("arg") or ""
        present, val = name in env, env.get(name, "")
        if op == ":-":
            return val if val else arg
        if op == "-":
            return val if present else arg
        if op in (":?", "?"):
            if (op == ":?" and not val) or (op == "?" and not present):
                raise KeyError(f"required variable {name} is missing: {arg}")
            return val
        if op == ":+":
            return arg if val else ""
        if op == "+":
            return arg if present else ""
        return val

    return _INTERPOLATION.sub(sub, value)


def interpolate(obj: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation of every string value (keys are left as they are, as Compose does)."""
    if isinstance(obj, str):
        return interpolate_str(obj, env)
    if isinstance(obj, dict):
        return {k: interpolate(v, env) for k, v in obj.items()}
    if isinstance(obj, list):
        return [interpolate(v, env) for v in obj]
    return obj


def compose_defaults() -> dict[str, str]:
    return envfile.compose_defaults(compose_raw())


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose file as Compose sees it after interpolation with ``env`` (default: nothing set)."""
    return interpolate(compose_raw(), env or {})


def parse_port(spec: str | int | dict[str, Any]) -> tuple[str | None, str | None, str]:
    """(host ip, host port, container port) of a short or long port syntax entry."""
    if isinstance(spec, dict):
        return spec.get("host_ip"), str(spec["published"]) if "published" in spec else None, str(spec["target"])
    spec = str(spec).split("/", 1)[0]
    parts = spec.rsplit(":", 2)
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    if len(parts) == 2:
        return None, parts[0], parts[1]
    return None, None, parts[0]


def parse_volume(spec: str | dict[str, Any]) -> tuple[str, str, bool]:
    """(source, target, read_only) of a short or long volume syntax entry."""
    if isinstance(spec, dict):
        return spec.get("source", ""), spec["target"], bool(spec.get("read_only"))
    parts = spec.split(":")
    read_only = len(parts) == 3 and "ro" in parts[2].split(",")
    return parts[0], parts[1], read_only


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    """Dependency -> condition (service_started for the short syntax)."""
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: (spec or {}).get("condition", "service_started") for d, spec in deps.items()}


# --------------------------------------------------------------------------- env files


@dataclass
class EnvEntry:
    name: str
    value: str
    active: bool  # False: a commented-out "# NAME=value" line
    comments: list[str]  # the comment lines just above it, without "# "


_ASSIGNMENT = re.compile(r"^(?P<comment>#\s*)?(?P<name>[A-Z][A-Z0-9_]*)=(?P<value>.*)$")


def parse_env_example(text: str) -> list[EnvEntry]:
    """Assignments, active or commented out, each with the comment block above it."""
    entries: list[EnvEntry] = []
    comments: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        m = _ASSIGNMENT.match(stripped)
        if m:
            value = m.group("value")
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            entries.append(EnvEntry(m.group("name"), value, not m.group("comment"), comments))
            comments = []
        elif stripped.startswith("#"):
            comments.append(stripped[1:].strip())
        else:
            comments = []
    return entries


# --------------------------------------------------------------------------- Dockerfile


def exec_form(args: str) -> list[str] | None:
    """The JSON array of an exec-form ENTRYPOINT/CMD/RUN, or None for the shell form."""
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def copy_sources(ins: Instruction) -> tuple[list[str], dict[str, str]]:
    """Sources and --flags of a COPY/ADD (the last word is the destination)."""
    words = ins.args.split()
    flags = {}
    while words and words[0].startswith("--"):
        key, _, val = words.pop(0)[2:].partition("=")
        flags[key] = val
    form = exec_form(" ".join(words))
    if form is not None:
        words = form
    return words[:-1], flags


def dockerignore_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore excludes ``path`` (relative to the context), by Docker's rules as far as kvpool uses them."""
    parts = Path(path.strip("/")).parts
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        hit = False
        for i in range(1, len(parts) + 1):  # a pattern matching a parent folder excludes what it holds
            prefix = "/".join(parts[:i])
            if fnmatch.fnmatchcase(prefix, pat) or (
                pat.startswith("**/") and any(fnmatch.fnmatchcase("/".join(parts[j:i]), pat[3:]) for j in range(i))
            ):
                hit = True
                break
        if hit:
            ignored = not negate
    return ignored


# --------------------------------------------------------------------------- metrics and PromQL


@cache
def metric_samples() -> dict[str, str]:
    """Sample name -> metric family, for every kvpool metric in the prometheus_client registry."""
    from prometheus_client import REGISTRY

    import gateway.metrics  # noqa: F401  (importing registers the collectors)
    import store.metrics  # noqa: F401
    import worker.metrics  # noqa: F401

    suffixes = {
        "counter": ["_total", "_created"],
        "gauge": [""],
        "histogram": ["_bucket", "_count", "_sum", "_created"],
        "gaugehistogram": ["_bucket", "_gcount", "_gsum"],
        "summary": ["", "_count", "_sum", "_created"],
        "info": ["_info"],
        "stateset": [""],
        "enum": [""],
        "unknown": [""],
    }
    out: dict[str, str] = {}
    for family in REGISTRY.collect():
        if family.name.startswith("kvpool_"):
            for suffix in suffixes[family.type]:
                out[family.name + suffix] = family.name
    return out


# Words of PromQL that are not metric names (functions are recognised by the "(" after them).
PROMQL_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "start",
    "end",
    "atan2",
}

_PROMQL_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_PROMQL_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_PROMQL_WORD = re.compile(r"(?<![A-Za-z0-9_:.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (label names, functions, keywords, strings, ranges excluded)."""
    s = _PROMQL_STRING.sub('""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = _PROMQL_GROUPING.sub(" ", s)
    names = set()
    for m in _PROMQL_WORD.finditer(s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_KEYWORDS:
            continue
        names.add(word)
    return names


def promql_label_values(expr: str, label: str) -> set[str]:
    return set(re.findall(rf'\b{re.escape(label)}\s*=~?\s*"([^"]*)"', expr))


def dashboards() -> dict[Path, dict[str, Any]]:
    return {p: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for p in dashboard.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def promtool() -> str:
    """Path of Prometheus' promtool; the test fails (not skips) without it."""
    import pytest

    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed: the Debian package `prometheus` provides it (apt-get install prometheus; deploy/setup.sh installs it)"
        )
    return path


def grafana_variables_to_promql(expr: str) -> str:
    """Replace Grafana's built-in interval variables so that promtool can parse the expression."""
    for var in ("$__rate_interval", "$__interval", "$__range"):
        expr = expr.replace("${" + var[1:] + "}", "5m").replace(var, "5m")
    return expr

"""deploy/.env.example, written from the settings classes, the ``kvpool`` command, docker-compose.yml and the Dockerfile.

``kvpool docs`` rewrites it (and ``kvpool docs --check`` fails when it is stale), so a
setting added to the code, or a variable added to docker-compose.yml, shows up in the
example with its description, its default and the value the stack runs with.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings

ENV_PREFIX = "KVPOOL_"


@dataclass(frozen=True)
class Setting:
    env: str  # KVPOOL_...
    description: str
    default: Any  # the Python default; None when unset
    section: str  # the class that declares it, or "command" for the CLI's own variables


@cache
def settings() -> dict[str, Setting]:
    """Every kvpool environment variable: the settings fields and the ``kvpool`` command's own options."""
    from gateway.cli import main
    from gateway.settings import GatewaySettings
    from store.settings import StoreSettings
    from worker.settings import PoolSettings, WorkerSettings

    out: dict[str, Setting] = {}
    seen: set[str] = set()
    for cls in (StoreSettings, PoolSettings, WorkerSettings, GatewaySettings):
        prefix = cls.model_config.get("env_prefix", "")
        assert prefix == ENV_PREFIX, f"{cls.__name__} reads {prefix!r}, not {ENV_PREFIX!r}"
        for name, field in cls.model_fields.items():
            if name in seen:
                continue
            seen.add(name)
            default = None if field.is_required() else field.get_default(call_default_factory=True)
            out[f"{prefix}{name.upper()}"] = Setting(f"{prefix}{name.upper()}", field.description or "", default, cls.__name__)
    for param in main.params:
        envvars = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
        for env in envvars:
            if env.startswith(ENV_PREFIX):
                default = param.default
                if getattr(param, "is_flag", False) and not isinstance(default, bool):
                    default = False
                out[env] = Setting(env, getattr(param, "help", "") or "", default, "command")
    return out


def render_env_value(value: Any) -> str:
    """A default as it would be written in an env file; '' for unset."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def settings_env(settings: BaseSettings) -> dict[str, str]:
    """The ``KVPOOL_*`` variables that give a process the values set in ``settings`` (those not left at their default)."""
    prefix = settings.model_config.get("env_prefix") or ""
    return {f"{prefix}{name.upper()}": render_env_value(getattr(settings, name)) for name in sorted(settings.model_fields_set)}


@cache
def compose_file(deploy: Path) -> dict[str, Any]:
    import yaml

    loaded: dict[str, Any] = yaml.safe_load((deploy / "docker-compose.yml").read_text())
    return loaded


# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}, ${VAR:+alt}, ${VAR+alt}, $VAR; $$ is a literal $.
_INTERPOLATION = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


@dataclass(frozen=True)
class Reference:
    name: str
    op: str | None  # ":-", "-", ":?", ... or None for ${VAR} / $VAR
    arg: str | None


def references(obj: Any) -> list[Reference]:
    """The variables interpolated in the string values of a parsed compose file (``$$`` escapes excluded)."""
    if isinstance(obj, dict):
        return [r for v in obj.values() for r in references(v)]
    if isinstance(obj, list):
        return [r for v in obj for r in references(v)]
    if not isinstance(obj, str):
        return []
    out = []
    for m in _INTERPOLATION.finditer(obj):
        if m.group("escaped"):
            continue
        name = m.group("braced") or m.group("named")
        out.append(Reference(name, m.group("op"), m.group("arg")))
    return out


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def compose_defaults(compose: dict[str, Any]) -> dict[str, str]:
    """``${VAR:-default}`` / ``${VAR-default}`` defaults in the compose file; a variable must have one default only."""
    out: dict[str, str] = {}
    for ref in references(compose):
        if ref.op in (":-", "-"):
            if out.get(ref.name, ref.arg) != ref.arg:
                raise ValueError(f"{ref.name} has two defaults in docker-compose.yml: {out[ref.name]!r} and {ref.arg!r}")
            out[ref.name] = ref.arg or ""
    return out


@dataclass(frozen=True)
class Instruction:
    line: int
    cmd: str  # upper case
    args: str
    stage: int  # index of the FROM this belongs to


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (no heredocs)."""
    out: list[Instruction] = []
    stage = -1
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not buf:
            start = n
        if line.endswith("\\"):
            buf.append(line[:-1].strip())
            continue
        buf.append(line)
        joined = " ".join(p for p in buf if p)
        buf = []
        cmd, _, args = joined.partition(" ")
        cmd = cmd.upper()
        if cmd == "FROM":
            stage += 1
        out.append(Instruction(start, cmd, args.strip(), stage))
    assert not buf, "the Dockerfile ends inside a continued line"
    return out


# Variables of docker-compose.yml that are not kvpool settings.
COMPOSE_VARIABLES = {
    "APP_IMAGE": "Image built from deploy/Dockerfile for the gateway, the workers and the model job.",
    "REDIS_IMAGE": "Redis image (chunk index and job queues).",
    "MINIO_IMAGE": "MinIO image (S3 endpoint for the chunk blobs). Any S3-compatible server will do.",
    "MC_IMAGE": "MinIO client image, for the createbucket job.",
    "PROMETHEUS_IMAGE": "Prometheus image.",
    "GRAFANA_IMAGE": "Grafana image.",
    "PUBLISH_ADDRESS": "Host address the published ports bind to. 0.0.0.0 exposes Redis and MinIO, which have no TLS, to the network.",
    "REDIS_PORT": "Host port of Redis (for workers on other machines and `kvpool store ...` from the host).",
    "MINIO_PORT": "Host port of MinIO's S3 API.",
    "MINIO_CONSOLE_PORT": "Host port of MinIO's web console.",
    "GATEWAY_PORT": "Host port of the gateway's OpenAI-compatible API (inside the stack it listens on 8000).",
    "WORKERS": "Worker replicas started by `docker compose up` (docker compose up --scale worker=N overrides it).",
    "WORKER_STOP_GRACE": "How long a stopping worker may finish its running job before it is killed.",
    "QUARANTINE_EXPIRE_DAYS": "Days after which blobs moved to quarantine/ expire (a bucket lifecycle rule set by the createbucket job).",
    "MODELS_SOURCE": "What is mounted at /models: the named volume `models`, or a host folder holding your GGUF files (e.g. /srv/models; readable by uid 10001, writable too if the model job must generate into it).",
    "PROMETHEUS_PORT": "Host port of Prometheus.",
    "PROMETHEUS_RETENTION": "How long Prometheus keeps samples.",
    "GRAFANA_PORT": "Host port of Grafana (dashboard `kvpool`; anonymous users may view).",
    "GRAFANA_ADMIN_USER": "Grafana administrator.",
    "GRAFANA_ADMIN_PASSWORD": "Grafana administrator's password: change it.",
}

# Said once more about some settings, for this deployment.
NOTES = {
    "KVPOOL_MODEL": "In this stack a path under /models (the model job generates a missing /models/kvpool-<size>-s<seed>.gguf, size tiny or bench), or s3://bucket/key.gguf.",
    "KVPOOL_STORE_URL": "The createbucket job creates this bucket (and expires quarantine/ in it).",
    "KVPOOL_S3_ACCESS_KEY_ID": "Also MinIO's root user in this stack.",
    "KVPOOL_S3_SECRET_ACCESS_KEY": "Also MinIO's root password in this stack (8 characters or more).",
    "KVPOOL_API_KEYS": """Quote the JSON with single quotes here: KVPOOL_API_KEYS='{"sk-a": "team-a"}'.""",
    "KVPOOL_N_GPU_LAYERS": "The image's llama.cpp is built for CPUs only.",
    "KVPOOL_PORT": "prometheus.yml scrapes gateway:8000 and the gateway's healthcheck probes it.",
    "KVPOOL_METRICS_PORT": "prometheus.yml scrapes every worker on 9100 and the workers' healthcheck probes it.",
    "KVPOOL_HOST": "0.0.0.0 in the image and the stack, so that other containers reach the gateway.",
}

HEADER = """\
# Settings of the kvpool stack (deploy/docker-compose.yml). Copy this file to deploy/.env
# and uncomment what you change:
#
#   cp deploy/.env.example deploy/.env
#
# Docker Compose reads deploy/.env for the ${VARIABLES} of docker-compose.yml, and hands
# the same file to the kvpool containers (gateway, workers, model job), so every KVPOOL_*
# line uncommented here reaches them. Each line shows the value the stack uses without it.
# Leave a setting commented out rather than empty: an empty value is not "unset".
#
# Generated from the settings classes and docker-compose.yml:
#   kvpool docs
"""

SECTIONS = {
    "StoreSettings": "kvpool settings: store (Redis index, blob backend)",
    "PoolSettings": "kvpool settings: the pool (the gateway and the workers read them, and must agree: model, chunk size, queue)",
    "WorkerSettings": "kvpool settings: workers (llama.cpp, the KV layout, publishing)",
    "GatewaySettings": "kvpool settings: gateway",
    "command": "kvpool settings: logging (options of the kvpool command)",
}


@cache
def image_env(deploy: Path) -> dict[str, str]:
    """ENV of the Dockerfile's final stage."""
    instructions = parse_dockerfile((deploy / "Dockerfile").read_text())
    last = max(i.stage for i in instructions)
    out: dict[str, str] = {}
    for ins in instructions:
        if ins.stage == last and ins.cmd == "ENV":
            words = shlex.split(ins.args)
            if len(words) >= 2 and "=" not in words[0]:
                out[words[0]] = " ".join(words[1:])
            else:
                for w in words:
                    key, _, value = w.partition("=")
                    out[key] = value
    return out


def fixed_in_compose(compose: dict[str, Any]) -> dict[str, dict[str, str]]:
    """KVPOOL_* set to a literal value in a service's environment: name -> {service: value}."""
    out: dict[str, dict[str, str]] = {}
    for name, service in compose["services"].items():
        for key, value in environment(service).items():
            if key.startswith(ENV_PREFIX) and "$" not in value:
                out.setdefault(key, {})[name] = value
    return out


def stack_value(env: str, deploy: Path) -> tuple[str, str]:
    """(value, where it comes from) of a setting in the stack when .env does not set it."""
    compose = compose_file(deploy)
    defaults, fixed, image = compose_defaults(compose), fixed_in_compose(compose), image_env(deploy)
    if env in defaults:
        return defaults[env], "compose-default"
    if env in fixed:
        values = set(fixed[env].values())
        if len(values) != 1:
            raise ValueError(f"docker-compose.yml fixes {env} to different values: {fixed[env]}")
        return values.pop(), "compose-fixed"
    if env in image:
        return image[env], "image"
    return render_env_value(settings()[env].default), "kvpool"


def shown_default(value: object) -> str:
    text = render_env_value(value)
    if value is None:
        return "(unset)"
    return text if text else "(empty)"


def _compose_section(compose: dict[str, Any]) -> list[str]:
    defaults = compose_defaults(compose)
    names = [n for n in dict.fromkeys(r.name for r in references(compose)) if not n.startswith(ENV_PREFIX)]
    missing = [n for n in names if n not in COMPOSE_VARIABLES]
    if missing:
        raise ValueError(f"describe these docker-compose.yml variables in {__file__}: {', '.join(missing)}")
    out = ["\n## The compose stack (variables of docker-compose.yml, not kvpool settings)\n"]
    return out + [f"\n# {COMPOSE_VARIABLES[n]}\n# {n}={defaults.get(n, '')}\n" for n in names]


def _setting_block(env: str, setting: Setting, deploy: Path, fixed: dict[str, dict[str, str]]) -> str:
    value, source = stack_value(env, deploy)
    lines = [setting.description, *([NOTES[env]] if env in NOTES else [])]
    default = f"kvpool default: {shown_default(setting.default)}."
    if source == "compose-fixed":
        default += f" docker-compose.yml sets it for the {', '.join(sorted(fixed[env]))} service: a value here has no effect."
    elif source == "image":
        default += " The image sets the value below."
    elif source == "compose-default":
        default += " The value below is docker-compose.yml's."
    lines.append(default)
    return "\n" + "".join(f"# {line}\n" for line in lines) + f"# {env}={value}\n"


def render(deploy: Path) -> str:
    """The text of ``deploy/.env.example``."""
    compose = compose_file(deploy)
    out = [HEADER, *_compose_section(compose)]
    fixed = fixed_in_compose(compose)
    section = None
    for env, setting in settings().items():
        if setting.section != section:
            section = setting.section
            out.append(f"\n## {SECTIONS[section]}\n")
        out.append(_setting_block(env, setting, deploy, fixed))
    return "".join(out)

"""Writes deploy/.env.example from the settings classes, the ``kvpool`` command and docker-compose.yml.

    .kvpool/venv/bin/python -m tests.deploy.envexample > deploy/.env.example

tests/deploy/test_env_example.py checks the file against the same sources, so a setting
added to the code (or a variable added to docker-compose.yml) fails the tests until the
file is regenerated.
"""

from __future__ import annotations

import shlex
import sys

from tests.deploy import deployfiles as df

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
#   .kvpool/venv/bin/python -m tests.deploy.envexample > deploy/.env.example
"""

SECTIONS = {
    "StoreSettings": "kvpool settings: store (Redis index, blob backend)",
    "WorkerSettings": "kvpool settings: workers (the gateway reads them too: both must agree on model, KV layout, chunk size)",
    "GatewaySettings": "kvpool settings: gateway",
    "command": "kvpool settings: logging (options of the kvpool command)",
}


def image_env() -> dict[str, str]:
    """ENV of the Dockerfile's final stage."""
    instructions = df.parse_dockerfile(df.DOCKERFILE.read_text())
    last = max(i.stage for i in instructions)
    out = {}
    for ins in instructions:
        if ins.stage == last and ins.cmd == "ENV":
            words = shlex.split(ins.args)
            if len(words) >= 2 and "=" not in words[0]:
                out[words[0]] = " ".join(words[1:])
            else:
                out.update(w.split("=", 1) for w in words)
    return out


def fixed_in_compose() -> dict[str, dict[str, str]]:
    """KVPOOL_* set to a literal value in a service's environment: name -> {service: value}."""
    out: dict[str, dict[str, str]] = {}
    for name, service in df.compose_raw()["services"].items():
        for key, value in df.environment(service).items():
            if key.startswith(df.ENV_PREFIX) and "$" not in value:
                out.setdefault(key, {})[name] = value
    return out


def stack_value(env: str) -> tuple[str, str]:
    """(value, where it comes from) of a setting in the stack when .env does not set it."""
    defaults = df.compose_defaults()
    fixed = fixed_in_compose()
    if env in defaults:
        return defaults[env], "compose-default"
    if env in fixed:
        values = set(fixed[env].values())
        assert len(values) == 1, f"{env} is fixed to different values: {fixed[env]}"
        return values.pop(), "compose-fixed"
    image = image_env()
    if env in image:
        return image[env], "image"
    return df.render_env_value(df.settings()[env].default), "kvpool"


def shown_default(value: object) -> str:
    text = df.render_env_value(value)
    if value is None:
        return "(unset)"
    return text if text else "(empty)"


def render() -> str:
    out = [HEADER]
    defaults = df.compose_defaults()
    compose_vars = [name for name in dict.fromkeys(r.name for r in df.references(df.compose_raw())) if not name.startswith(df.ENV_PREFIX)]
    missing = [name for name in compose_vars if name not in COMPOSE_VARIABLES]
    if missing:
        raise SystemExit(f"describe these docker-compose.yml variables in {__file__}: {', '.join(missing)}")
    out.append("\n## The compose stack (variables of docker-compose.yml, not kvpool settings)\n")
    for name in compose_vars:
        out.append(f"\n# {COMPOSE_VARIABLES[name]}\n# {name}={defaults.get(name, '')}\n")

    fixed = fixed_in_compose()
    section = None
    for env, setting in df.settings().items():
        if setting.section != section:
            section = setting.section
            out.append(f"\n## {SECTIONS[section]}\n")
        value, source = stack_value(env)
        lines = [setting.description]
        if env in NOTES:
            lines.append(NOTES[env])
        default = f"kvpool default: {shown_default(setting.default)}."
        if source == "compose-fixed":
            services = ", ".join(sorted(fixed[env]))
            default += f" docker-compose.yml sets it for the {services} service: a value here has no effect."
        elif source == "image":
            default += " The image sets the value below."
        elif source == "compose-default":
            default += " The value below is docker-compose.yml's."
        lines.append(default)
        block = "".join(f"# {line}\n" for line in lines)
        out.append(f"\n{block}# {env}={value}\n")
    return "".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())

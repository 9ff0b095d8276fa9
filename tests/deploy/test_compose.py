"""deploy/docker-compose.yml: valid Compose, and in agreement with the code, the Dockerfile and prometheus.yml."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import jsonschema
import pytest
import yaml

from tests.deploy import deployfiles as df

KVPOOL_SERVICES = ("model", "gateway", "worker")  # run the image built from deploy/Dockerfile
ROLE_SETTINGS = {"KVPOOL_HOST", "KVPOOL_PORT", "KVPOOL_METRICS_PORT"}  # may differ between gateway and workers


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    """The Compose file as `docker compose` would see it with no .env: every variable at its default."""
    return df.compose()


@pytest.fixture(scope="module")
def services(spec: dict[str, Any]) -> dict[str, Any]:
    return spec["services"]


def compose_schema() -> dict[str, Any]:
    """The Compose Specification's JSON schema (compose-spec/schema/compose-spec.json), as vendored by check-jsonschema."""
    try:
        files = resources.files("check_jsonschema.builtin_schemas.vendor")
    except ModuleNotFoundError:
        pytest.fail("check-jsonschema is not installed: it ships the Compose Specification schema (pip install check-jsonschema)")
    return json.loads(files.joinpath("compose-spec.json").read_text())


def schema_errors(document: Any) -> list[str]:
    schema = compose_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in sorted(cls(schema).iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))
    ]


# --------------------------------------------------------------------------- the Compose Specification


def test_schema_is_the_compose_specification() -> None:
    schema = compose_schema()
    assert schema["title"] == "Compose Specification"
    assert "services" in schema["properties"]


@pytest.mark.parametrize("stage", ["as written", "interpolated"])
def test_compose_file_matches_the_compose_specification(stage: str) -> None:
    document = df.compose_raw() if stage == "as written" else df.compose()
    errors = schema_errors(document)
    assert not errors, "docker-compose.yml does not match the Compose Specification:\n" + "\n".join(errors)


def test_schema_check_catches_mistakes() -> None:
    """The validation above would fail on a misspelt key or a bad depends_on condition."""
    document = df.compose()
    document["services"]["worker"]["restrat"] = "always"
    document["services"]["gateway"]["depends_on"]["redis"]["condition"] = 1
    errors = schema_errors(document)
    assert any("restrat" in e for e in errors), errors
    assert any("gateway/depends_on" in e for e in errors), errors


def test_every_variable_has_a_default() -> None:
    """`docker compose up` works without a .env file."""
    missing = sorted({r.name for r in df.references(df.compose_raw()) if r.op not in (":-", "-")})
    assert not missing, f"variables without a ${{VAR:-default}}: {missing}"


# --------------------------------------------------------------------------- settings


def test_every_kvpool_variable_is_a_setting() -> None:
    known = set(df.settings())
    used = {r.name for r in df.references(df.compose_raw()) if r.name.startswith(df.ENV_PREFIX)}
    for service in df.compose_raw()["services"].values():
        used |= {k for k in df.environment(service) if k.startswith(df.ENV_PREFIX)}
    assert used, "docker-compose.yml sets no KVPOOL_* variable"
    unknown = sorted(used - known)
    assert not unknown, f"not kvpool settings (no such field in GatewaySettings/WorkerSettings/StoreSettings): {unknown}"


@pytest.mark.parametrize("name", ["gateway", "worker"])
def test_service_environment_is_valid_settings(name: str, services: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment each kvpool container gets (image ENV, then compose) passes the settings' own validation."""
    from gateway.pool.envfile import image_env
    from gateway.settings import GatewaySettings
    from worker.settings import WorkerSettings

    for key in list(os.environ):
        if key.startswith(df.ENV_PREFIX):
            monkeypatch.delenv(key)
    env = {**image_env(df.DEPLOY), **df.environment(services[name])}
    for key, value in env.items():
        if key.startswith(df.ENV_PREFIX):
            monkeypatch.setenv(key, value)
    s = GatewaySettings() if name == "gateway" else WorkerSettings()
    assert s.resolved_store_url().startswith("s3://")
    assert s.s3_endpoint_url == "http://minio:9000"
    assert s.redis_url.startswith("redis://redis:")
    assert s.model.startswith("/models/")
    if name == "gateway":
        assert s.host == "0.0.0.0"
    else:
        assert s.metrics_port is not None and s.metrics_port > 0


def test_gateway_and_workers_agree(services: dict[str, Any]) -> None:
    """Model, KV layout, chunk size, store and Redis: the gateway computes the same chain keys as the workers."""
    gateway, worker = df.environment(services["gateway"]), df.environment(services["worker"])

    def shared(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k.startswith(df.ENV_PREFIX) and k not in ROLE_SETTINGS}

    assert shared(gateway) == shared(worker)
    assert {"KVPOOL_MODEL", "KVPOOL_REDIS_URL", "KVPOOL_STORE_URL"} <= set(shared(gateway))
    for name in KVPOOL_SERVICES:
        assert df.environment(services[name])["KVPOOL_MODEL"] == gateway["KVPOOL_MODEL"], name
        assert services[name].get("env_file"), f"{name} does not get deploy/.env: settings set there would not reach it"


# --------------------------------------------------------------------------- services, ports, dependencies


def test_services(services: dict[str, Any]) -> None:
    assert {"redis", "minio", "createbucket", "model", "gateway", "worker", "prometheus", "grafana"} <= set(services)


def test_redis_persists_and_reports_health(services: dict[str, Any]) -> None:
    redis = services["redis"]
    command = redis["command"] if isinstance(redis["command"], list) else redis["command"].split()
    assert command[0] == "redis-server"
    assert command[command.index("--appendonly") + 1] == "yes", "Redis without AOF loses the index and queued jobs on restart"
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]
    assert ("redis", "/data") in {df.parse_volume(v)[:2] for v in redis["volumes"]}


def test_minio_reports_health_and_keeps_data(services: dict[str, Any]) -> None:
    minio = services["minio"]
    assert minio["healthcheck"]["test"], "minio has no healthcheck"
    assert ("minio", "/data") in {df.parse_volume(v)[:2] for v in minio["volumes"]}
    assert "/data" in minio["command"]
    env = df.environment(minio)
    kv = df.environment(services["gateway"])
    assert (env["MINIO_ROOT_USER"], env["MINIO_ROOT_PASSWORD"]) == (kv["KVPOOL_S3_ACCESS_KEY_ID"], kv["KVPOOL_S3_SECRET_ACCESS_KEY"])
    assert len(env["MINIO_ROOT_PASSWORD"]) >= 8, "MinIO refuses root passwords shorter than 8 characters"


@pytest.mark.parametrize("name", ["gateway", "worker"])
def test_kvpool_services_wait_for_their_dependencies(name: str, services: dict[str, Any]) -> None:
    deps = df.depends_on(services[name])
    assert deps.get("redis") == "service_healthy"
    assert deps.get("minio") == "service_healthy"
    assert deps.get("createbucket") == "service_completed_successfully"
    assert deps.get("model") == "service_completed_successfully"
    assert df.depends_on(services["createbucket"]).get("minio") == "service_healthy"
    for dep, condition in deps.items():
        if condition == "service_healthy":
            assert services[dep].get("healthcheck"), f"{name} waits for {dep} to be healthy, but {dep} has no healthcheck"
        if condition == "service_completed_successfully":
            assert services[dep].get("restart", "no") == "no", f"{dep} is a one-shot job: it must not restart"


def test_dependencies_exist_and_do_not_cycle(services: dict[str, Any]) -> None:
    graph = {name: set(df.depends_on(s)) for name, s in services.items()}
    for name, deps in graph.items():
        assert deps <= set(services), f"{name} depends on unknown services {sorted(deps - set(services))}"
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for dep in graph[name]:
                visit(dep, (*path, name))
            done.add(name)

    for name in graph:
        visit(name, ())


def test_gateway_port_and_healthcheck(services: dict[str, Any]) -> None:
    from gateway.settings import GatewaySettings

    gateway = services["gateway"]
    port = df.environment(gateway).get("KVPOOL_PORT", str(GatewaySettings.model_fields["port"].default))
    assert port == str(GatewaySettings.model_fields["port"].default) == "8000"
    published = [df.parse_port(p) for p in gateway["ports"]]
    assert [c for _, _, c in published] == [port], f"the gateway publishes {published}, but listens on {port}"
    test = " ".join(gateway["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/healthz" in test
    assert gateway.get("command") == ["gateway"]


def test_worker_is_scalable(services: dict[str, Any]) -> None:
    worker = services["worker"]
    assert "container_name" not in worker, "a fixed container_name makes `--scale worker=N` fail"
    assert not worker.get("ports"), "a host port makes `--scale worker=N` fail: use expose"
    assert "hostname" not in worker
    metrics_port = df.environment(worker)["KVPOOL_METRICS_PORT"]
    assert metrics_port in [str(p) for p in worker.get("expose", [])]
    assert f"127.0.0.1:{metrics_port}/metrics" in " ".join(worker["healthcheck"]["test"])
    assert worker.get("command") == ["worker"]


def test_only_the_shared_services_have_fixed_names(spec: dict[str, Any]) -> None:
    assert not [name for name, s in spec["services"].items() if "container_name" in s]


def test_commands_are_kvpool_commands(services: dict[str, Any]) -> None:
    """Each kvpool service runs a subcommand the `kvpool` CLI has."""
    from gateway.cli import main

    ctx = click.Context(main)
    for name in ("gateway", "worker"):
        sub = services[name]["command"][0]
        assert main.get_command(ctx, sub) is not None, f"{name}: kvpool has no command {sub!r}"
    model_group = main.get_command(ctx, "model")
    assert isinstance(model_group, click.Group) and model_group.get_command(ctx, "make") is not None
    make = model_group.get_command(ctx, "make")
    assert {"--size", "--seed", "--out"} <= {o for p in make.params for o in p.opts}
    assert "kvpool model make" in services["model"]["command"][0]


def test_kvpool_services_use_the_image_built_from_deploy_dockerfile(services: dict[str, Any]) -> None:
    images = set()
    for name in KVPOOL_SERVICES:
        s = services[name]
        build = s["build"]
        context = (df.COMPOSE_FILE.parent / build["context"]).resolve()
        assert context == df.REPO, f"{name}: build context {context} is not the repository root"
        assert (context / build.get("dockerfile", "Dockerfile")).resolve() == df.DOCKERFILE
        images.add(s["image"])
    assert len(images) == 1, f"gateway, worker and model must share one image: {images}"


def test_published_ports_bind_to_one_configurable_address(services: dict[str, Any]) -> None:
    """Published ports listen on ${PUBLISH_ADDRESS:-127.0.0.1} (not the whole network by default), each at its own ${X_PORT}."""
    pattern = re.compile(r"^\$\{PUBLISH_ADDRESS:-127\.0\.0\.1\}:\$\{[A-Z_]+_PORT:-\d+\}:\d+$")
    for name, s in df.compose_raw()["services"].items():
        for p in s.get("ports", []):
            assert isinstance(p, str) and pattern.match(p), f"{name}: {p!r} is not ${{PUBLISH_ADDRESS:-127.0.0.1}}:${{X_PORT:-n}}:n"
    hosts = [df.parse_port(p)[1] for s in services.values() for p in s.get("ports", [])]
    assert len(hosts) == len(set(hosts)), f"two services publish the same host port: {hosts}"


# --------------------------------------------------------------------------- volumes and the model


def test_named_volumes(spec: dict[str, Any]) -> None:
    declared = set(spec.get("volumes") or {})
    assert {"redis", "minio", "models"} <= declared
    for name, s in spec["services"].items():
        for v in s.get("volumes", []):
            source = df.parse_volume(v)[0]
            if source and not source.startswith((".", "/", "~")):
                assert source in declared, f"{name} mounts undeclared volume {source!r}"
            elif source.startswith("."):
                assert (df.COMPOSE_FILE.parent / source).exists(), f"{name} mounts missing {source}"


def test_model_volume_shared(services: dict[str, Any]) -> None:
    """The model job writes the models volume; gateway and workers read the same file from it."""
    model_path = df.environment(services["gateway"])["KVPOOL_MODEL"]
    mounts = {}
    for name in KVPOOL_SERVICES:
        volumes = [df.parse_volume(v) for v in services[name]["volumes"]]
        found = [(src, ro) for src, target, ro in volumes if model_path.startswith(target.rstrip("/") + "/")]
        assert len(found) == 1, f"{name} does not mount the folder of {model_path}"
        mounts[name] = found[0]
    assert len({src for src, _ in mounts.values()}) == 1, f"not the same volume: {mounts}"
    assert not mounts["model"][1], "the model job must be able to write the model"
    assert mounts["gateway"][1] and mounts["worker"][1], "gateway and workers should mount the models read-only"


def _script(service: dict[str, Any]) -> str:
    assert service["entrypoint"][:2] == ["/bin/sh", "-c"]
    (script,) = service["command"]
    return script


def _fake_command(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run_script(shell: str, service: dict[str, Any], env: dict[str, str], fakes: Path) -> subprocess.CompletedProcess[str]:
    """The service's script under ``shell``, with the stand-in commands in ``fakes`` first on the PATH."""
    return subprocess.run(
        [shell, "-c", _script(service)],
        env={**env, "PATH": f"{fakes}:/usr/bin:/bin"},
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )


SHELLS = ["sh"] + (["bash"] if shutil.which("bash") else [])  # sh: python:3.11-slim's dash; bash: the mc image's


@pytest.mark.parametrize("shell", SHELLS)
def test_model_job_generates_the_default_model(shell: str, services: dict[str, Any], tmp_path: Path) -> None:
    """Runs the model service's script with the real `kvpool model make`: the default KVPOOL_MODEL is generated, once."""
    from worker.models.synth import SIZES

    script = _script(services["model"])
    default = Path(df.environment(services["model"])["KVPOOL_MODEL"])
    size = default.name.removeprefix("kvpool-").rsplit("-s", 1)[0]
    assert size in SIZES, f"{default.name}: no model size {size!r} ({sorted(SIZES)})"
    target = tmp_path / "models" / default.name
    kvpool = Path(sys.executable).parent / "kvpool"
    if not kvpool.exists():
        kvpool = Path(shutil.which("kvpool") or "")
    assert kvpool.name == "kvpool", "the kvpool command is not installed (pip install -e .)"
    env = {"PATH": f"{kvpool.parent}:/usr/bin:/bin", "KVPOOL_MODEL": str(target), "HOME": str(tmp_path)}
    r = subprocess.run([shell, "-c", script], env=env, check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert target.read_bytes()[:4] == b"GGUF"
    mtime = target.stat().st_mtime_ns
    r = subprocess.run([shell, "-c", script], env=env, check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"model: {target}" in r.stdout
    assert target.stat().st_mtime_ns == mtime, "an existing model was generated again"


@pytest.mark.parametrize("shell", SHELLS)
def test_model_job_fails_on_a_missing_own_model(shell: str, services: dict[str, Any], tmp_path: Path) -> None:
    _fake_command(tmp_path, "kvpool", "echo called >&2; exit 3\n")
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "KVPOOL_MODEL": str(tmp_path / "llama-3-8b.Q4_K_M.gguf")}
    r = subprocess.run([shell, "-c", _script(services["model"])], env=env, check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert "model not found" in r.stderr and "called" not in r.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_model_job_leaves_s3_models_to_the_workers(shell: str, services: dict[str, Any], tmp_path: Path) -> None:
    """KVPOOL_MODEL=s3://... is what worker.models.fetch.resolve_model downloads itself: the job neither generates nor fails."""
    _fake_command(tmp_path, "kvpool", "echo called >&2; exit 3\n")
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "KVPOOL_MODEL": "s3://kvpool/models/kvpool-tiny-s0.gguf"}
    r = subprocess.run([shell, "-c", _script(services["model"])], env=env, check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "called" not in r.stderr


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("store_url", ["default", "s3://pool", "s3://pool/", "s3://pool/team/cache", "s3://pool/team/cache/"])
def test_createbucket_job(shell: str, store_url: str, services: dict[str, Any], tmp_path: Path) -> None:
    """Runs the createbucket script with a stand-in `mc`: it creates the store's bucket and expires exactly the store's quarantine/ keys."""
    from store.backends.s3 import S3Backend
    from store.maintenance import QUARANTINE_PREFIX

    job = services["createbucket"]
    env = df.environment(job)
    if store_url != "default":
        env["KVPOOL_STORE_URL"] = store_url
    log = tmp_path / "mc.log"
    _fake_command(tmp_path, "mc", f'echo "$*" >>{log}\nif [ "$1" = ilm ]; then cat >{tmp_path}/lifecycle.json; fi\n')
    r = _run_script(shell, job, env, tmp_path)
    assert r.returncode == 0, r.stderr

    bucket, _, prefix = env["KVPOOL_STORE_URL"].removeprefix("s3://").partition("/")
    client = SimpleNamespace(meta=SimpleNamespace(endpoint_url=env["KVPOOL_S3_ENDPOINT_URL"]))
    backend = S3Backend(client, bucket, prefix)  # the store's own key layout
    calls = log.read_text().splitlines()
    assert (
        calls[0]
        == f"alias set kvpool {env['KVPOOL_S3_ENDPOINT_URL']} {env['KVPOOL_S3_ACCESS_KEY_ID']} {env['KVPOOL_S3_SECRET_ACCESS_KEY']}"
    )
    assert calls[1] == f"mb --ignore-existing kvpool/{bucket}"
    assert calls[2] == f"ilm import kvpool/{bucket}"
    (rule,) = json.loads((tmp_path / "lifecycle.json").read_text())["Rules"]
    assert rule["Filter"]["Prefix"] == backend.prefix + QUARANTINE_PREFIX
    assert rule["Expiration"]["Days"] == int(env["QUARANTINE_EXPIRE_DAYS"])
    assert rule["Status"] == "Enabled"


@pytest.mark.parametrize("shell", SHELLS)
def test_createbucket_job_survives_a_failed_lifecycle_rule(shell: str, services: dict[str, Any], tmp_path: Path) -> None:
    """An S3 server without lifecycle support does not stop the stack; a failed bucket creation does."""
    job = services["createbucket"]
    _fake_command(tmp_path, "mc", 'if [ "$1" = ilm ]; then exit 1; fi\n')
    r = _run_script(shell, job, df.environment(job), tmp_path)
    assert r.returncode == 0 and "warning" in r.stderr
    _fake_command(tmp_path, "mc", 'if [ "$1" = mb ]; then exit 1; fi\n')
    r = _run_script(shell, job, df.environment(job), tmp_path)
    assert r.returncode != 0


# --------------------------------------------------------------------------- prometheus and grafana wiring


def test_prometheus_gets_deploy_prometheus_yml(services: dict[str, Any]) -> None:
    prom = services["prometheus"]
    mounts = {df.parse_volume(v)[1]: df.parse_volume(v)[0] for v in prom["volumes"]}
    flags = dict(a.split("=", 1) for a in prom["command"] if a.startswith("--") and "=" in a)
    config = flags.get("--config.file", "/etc/prometheus/prometheus.yml")
    assert (df.COMPOSE_FILE.parent / mounts[config]).resolve() == df.PROMETHEUS_FILE


def test_grafana_gets_provisioning_and_dashboards(services: dict[str, Any]) -> None:
    grafana = services["grafana"]
    mounts = {
        df.parse_volume(v)[1]: (df.COMPOSE_FILE.parent / df.parse_volume(v)[0]).resolve()
        for v in grafana["volumes"]
        if df.parse_volume(v)[0].startswith(".")
    }
    assert mounts.get("/etc/grafana/provisioning") == df.GRAFANA / "provisioning"
    providers = yaml.safe_load((df.GRAFANA / "provisioning" / "dashboards" / "kvpool.yml").read_text())["providers"]
    for provider in providers:
        path = provider["options"]["path"]
        assert mounts.get(path) == df.DASHBOARDS, (
            f"the dashboard provider reads {path}, which compose does not mount from deploy/grafana/dashboards"
        )
    home = df.environment(grafana).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        folder, _, name = home.rpartition("/")
        assert (mounts[folder] / name).is_file(), home

"""deploy/kubernetes against the code: real settings from one source, secrets only from Secrets, probes on real endpoints, the queue the code uses."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from fastapi.testclient import TestClient
from rq import Queue

from tests.deploy import deployfiles as df
from tests.deploy import kube
from worker.protocol import worker_queue

CREDENTIALS = {"KVPOOL_REDIS_URL", "KVPOOL_S3_ACCESS_KEY_ID", "KVPOOL_S3_SECRET_ACCESS_KEY", "KVPOOL_TENANT_SECRET", "KVPOOL_API_KEYS"}
"""Settings that hold (or may hold) a password or key."""
SECRET_LOOKING = re.compile(r"PASSWORD|SECRET|ACCESS_KEY|API_KEY|TOKEN|REDISCLI_AUTH")
URL_WITH_PASSWORD = re.compile(r"://[^/@\s:]*:[^/@\s]+@")
FROM_THE_POD = {"KVPOOL_WORKER_NAME", "KVPOOL_N_THREADS", "KVPOOL_N_THREADS_BATCH"}
"""Settings a worker takes from its own pod (downward API), not from the shared ConfigMap."""


@pytest.fixture(scope="module", params=kube.OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, kube.build(request.param)


# --------------------------------------------------------------------------- settings


def test_every_kvpool_variable_is_a_real_setting(overlay) -> None:
    _, objects = overlay
    known = df.settings()
    names = set(kube.kvpool_config(objects))
    names |= {e["name"] for _, c in kube.all_containers(objects) for e in c.get("env", []) if e["name"].startswith(df.ENV_PREFIX)}
    assert not sorted(names - set(known)), "not kvpool settings"
    kube.settings_from(kube.kvpool_config(objects))  # and the values parse as the processes would parse them


def test_gateway_and_workers_read_one_configmap_and_the_same_secrets(overlay) -> None:
    _, objects = overlay
    kvpool_pods = [kube.find(objects, "Deployment", n) for n in ("kvpool-gateway", "kvpool-worker")]
    sources = set()
    for workload in kvpool_pods:
        for c in kube.containers(workload):
            refs = [r["configMapRef"]["name"] for r in c.get("envFrom", []) if "configMapRef" in r]
            assert len(refs) == 1, f"{c['name']}: {refs}"
            sources.add(refs[0])
            for e in c.get("env", []):
                if e["name"].startswith(df.ENV_PREFIX):
                    assert "value" not in e, f"{c['name']} sets {e['name']} itself: it belongs in the ConfigMap"
                    assert e["name"] in CREDENTIALS | FROM_THE_POD, e["name"]
    assert len(sources) == 1 and not set(kube.kvpool_config(objects)) & (CREDENTIALS | FROM_THE_POD)
    secret_refs = [
        {
            e["name"]: e["valueFrom"]["secretKeyRef"]
            for c in kube.containers(w, init=False)
            for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        for w in kvpool_pods
    ]
    shared = set(secret_refs[0]) & set(secret_refs[1])
    assert shared >= {"KVPOOL_REDIS_URL", "KVPOOL_S3_ACCESS_KEY_ID", "KVPOOL_S3_SECRET_ACCESS_KEY"}
    assert all(secret_refs[0][k] == secret_refs[1][k] for k in shared)


# --------------------------------------------------------------------------- secrets


def test_secrets_are_never_inline(overlay) -> None:
    import base64

    name, objects = overlay
    secret_values = {base64.b64decode(v).decode() for s in kube.of_kind(objects, "Secret") for v in s.get("data", {}).values()}
    for cm in kube.of_kind(objects, "ConfigMap"):
        data = cm.get("data", {})
        assert not [k for k in data if k in CREDENTIALS or SECRET_LOOKING.search(k)], cm["metadata"]["name"]
        assert not [v for v in data.values() if URL_WITH_PASSWORD.search(v) or v in secret_values], cm["metadata"]["name"]
    for workload, c in kube.all_containers(objects):
        for e in c.get("env", []):
            where = f"{workload['metadata']['name']}/{c['name']}: {e['name']}"
            if e["name"] in CREDENTIALS or SECRET_LOOKING.search(e["name"]):
                assert "secretKeyRef" in e.get("valueFrom", {}), f"{where} is not from a Secret"
            assert not URL_WITH_PASSWORD.search(e.get("value", "")) and e.get("value") not in secret_values, f"{where} is inline"
    if name in kube.EXTERNAL_STATE:
        assert not kube.of_kind(objects, "Secret"), "prod makes no Secrets: they are created in the cluster, never kept in the repository"
    for path in kube.KUBERNETES.rglob("kustomization.yaml"):
        assert not [g for g in _secret_generators(path) if "literals" in g], f"{path}: secrets from literals"


def test_every_secret_reference_is_a_key_the_dev_secrets_have() -> None:
    objects = kube.build("dev")
    secrets = {s["metadata"]["name"]: set(s.get("data", {})) for s in kube.of_kind(objects, "Secret")}
    for workload, c in kube.all_containers(objects):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref and not ref.get("optional"):
                assert ref["key"] in secrets.get(ref["name"], set()), f"{workload['metadata']['name']}/{c['name']}: {ref}"
    auth = kube.find(objects, "TriggerAuthentication", "kvpool-redis")
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["key"] in secrets[ref["name"]]


def test_keda_reaches_the_redis_that_kvpool_uses() -> None:
    """KEDA takes an address and a password, kvpool a URL: in dev's Secret they say the same, and the database is the trigger's."""
    import base64

    objects = kube.build("dev")
    secret = {k: base64.b64decode(v).decode() for k, v in kube.find(objects, "Secret", "kvpool-redis")["data"].items()}
    url = urlsplit(secret["url"])
    assert f"{url.hostname}:{url.port}" == secret["address"] and url.password == secret["password"]
    trigger = kube.find(objects, "ScaledObject", "kvpool-worker")["spec"]["triggers"][0]
    assert trigger["metadata"]["databaseIndex"] == url.path.lstrip("/")
    service, namespace, *_ = (url.hostname or "").split(".")
    redis_service = kube.find(objects, "Service", service)
    assert namespace == redis_service["metadata"]["namespace"], "KEDA resolves the address from its own namespace: the full name"
    assert redis_service["spec"]["ports"][0]["port"] == url.port


def _secret_generators(path: Path) -> list[Any]:
    import yaml

    return (yaml.safe_load(path.read_text()) or {}).get("secretGenerator", [])


# --------------------------------------------------------------------------- the queue


def test_the_keda_trigger_is_the_shared_queue_the_code_uses(overlay) -> None:
    _, objects = overlay
    settings = kube.settings_from(kube.kvpool_config(objects))
    key = Queue(settings.queue, connection=redis.Redis()).key  # RQ's list key; no connection is made
    triggers = kube.find(objects, "ScaledObject", "kvpool-worker")["spec"]["triggers"]
    assert [(t["type"], t["metadata"]["listName"]) for t in triggers] == [("redis", key)]
    assert key == f"rq:queue:{settings.queue}"
    private = Queue(worker_queue("some-pod"), connection=redis.Redis()).key
    assert private != key and private.startswith(key), "private queues are drained by their own live worker, or handed to the shared one"


def test_a_renamed_queue_is_followed_by_the_trigger(tmp_path: Path) -> None:
    """A second pool in a new namespace (an upgrade) renames KVPOOL_QUEUE; components/queue keeps the trigger on it."""
    root = Path(__import__("os").path.relpath(kube.KUBERNETES, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{root}/overlays/prod]\nnamespace: kvpool-v2\ncomponents: [{root}/components/queue]\n"
        "configMapGenerator:\n- name: kvpool-config\n  behavior: merge\n  literals: [KVPOOL_QUEUE=kvpool-v2]\n"
    )
    objects = kube.kustomize(tmp_path)
    assert kube.kvpool_config(objects)["KVPOOL_QUEUE"] == "kvpool-v2"
    assert kube.find(objects, "ScaledObject", "kvpool-worker")["spec"]["triggers"][0]["metadata"]["listName"] == "rq:queue:kvpool-v2"
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"kvpool-v2"}


# --------------------------------------------------------------------------- probes


def test_gateway_probes_are_routes_of_the_gateway(overlay, tiny_model: Path, tmp_path: Path) -> None:
    from gateway.app import create_app
    from gateway.pool.procs import free_port
    from gateway.settings import GatewaySettings

    _, objects = overlay
    gateway = kube.find(objects, "Deployment", "kvpool-gateway")
    c = kube.container(gateway, "gateway")
    config = kube.kvpool_config(objects)
    settings = GatewaySettings(redis_url=f"redis://127.0.0.1:{free_port()}/0", store_url=str(tmp_path / "store"), connect_timeout_s=0.2)
    client = TestClient(create_app(settings, tiny_model))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert kube.named_port(c, get["port"]) == int(config["KVPOOL_PORT"])
        status = client.get(get["path"]).status_code
        assert status in (200, 503), f"{probe} {get['path']}: {status}"
    assert client.get(c["livenessProbe"]["httpGet"]["path"]).status_code == 200, "liveness does not depend on Redis"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_worker_probes_are_endpoints_of_the_worker_health_server(overlay) -> None:
    import urllib.error
    import urllib.request

    from worker.process.health import Health, serve

    _, objects = overlay
    c = kube.container(kube.find(objects, "Deployment", "kvpool-worker"), "worker")
    config = kube.kvpool_config(objects)
    server = serve(Health(), 0, host="127.0.0.1")
    try:
        for probe, expected in (("startupProbe", 200), ("livenessProbe", 200), ("readinessProbe", 503)):
            get = c[probe]["httpGet"]
            assert kube.named_port(c, get["port"]) == int(config["KVPOOL_METRICS_PORT"])
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}{get['path']}", timeout=5).status
            except urllib.error.HTTPError as e:
                status = e.code
            assert status == expected, f"{probe} {get['path']} of a worker still loading its model: {status}"
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- monitoring


def test_monitors_scrape_the_gateway_and_the_workers_under_the_dashboards_job_names(overlay) -> None:
    _, objects = overlay
    service = kube.find(objects, "Service", "kvpool-gateway")
    smon = kube.find(objects, "ServiceMonitor", "kvpool-gateway")
    assert kube.labels_match(smon["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert {e["port"] for e in smon["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    worker = kube.find(objects, "Deployment", "kvpool-worker")
    pods = worker["spec"]["template"]["metadata"]["labels"]
    pmon = kube.find(objects, "PodMonitor", "kvpool-worker")
    assert kube.labels_match(pmon["spec"]["selector"]["matchLabels"], pods)
    for endpoint in pmon["spec"]["podMetricsEndpoints"]:
        assert kube.named_port(kube.container(worker, "worker"), endpoint["port"]) == int(
            kube.kvpool_config(objects)["KVPOOL_METRICS_PORT"]
        )

    jobs = {service["metadata"]["labels"][smon["spec"]["jobLabel"]], pods[pmon["spec"]["jobLabel"]]}
    assert jobs == {"gateway", "worker"}
    wanted = {
        v
        for d in df.dashboards().values()
        for p in df.panels(d)
        for t in p.get("targets", [])
        for v in df.promql_label_values(t.get("expr", ""), "job")
    }
    assert wanted and wanted <= jobs


def test_the_dashboard_configmap_is_the_one_json_file(overlay) -> None:
    import yaml

    _, objects = overlay
    dashboard = kube.find(objects, "ConfigMap", "kvpool-grafana-dashboard")
    assert dashboard["data"] == {"kvpool.json": (df.DASHBOARDS / "kvpool.json").read_text()}
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = yaml.safe_load(kube.find(objects, "ConfigMap", "kvpool-grafana-datasource")["data"]["kvpool-datasource.yaml"])
    uids = {
        t["datasource"]["uid"] for d in df.dashboards().values() for p in df.panels(d) for t in p.get("targets", []) if t.get("datasource")
    }
    assert uids == {ds["uid"] for ds in source["datasources"]}

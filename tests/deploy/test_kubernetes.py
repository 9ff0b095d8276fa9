"""deploy/kubernetes: every overlay builds offline, every object is valid for Kubernetes or its CRD, and each says what the code does."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from gateway.pool.envfile import image_env
from tests.deploy import deployfiles as df
from tests.deploy import kube

BUILDS = ("base", *kube.OVERLAYS)


@pytest.fixture(scope="module", params=kube.OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, kube.build(request.param)


def test_every_overlay_has_a_directory_and_builds() -> None:
    assert sorted(p.name for p in (kube.KUBERNETES / "overlays").iterdir() if p.is_dir()) == sorted(kube.OVERLAYS)
    for name in BUILDS:
        assert kube.build(name), f"{name} builds nothing"


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", kube.K8S_VERSIONS)
@pytest.mark.parametrize("name", BUILDS)
def test_every_kubernetes_object_matches_the_openapi_schema(name: str, version: str) -> None:
    crds = kube.vendored_crds()
    errors = [
        f"{o['kind']}/{o['metadata']['name']}: {e}"
        for o in kube.build(name)
        if (o["apiVersion"], o["kind"]) not in crds
        for e in kube.k8s_errors(o, version)
    ]
    assert not errors, f"{name} is not valid for Kubernetes {version}:\n" + "\n".join(errors)


@pytest.mark.parametrize("name", BUILDS)
def test_every_custom_resource_matches_its_crd(name: str) -> None:
    custom = [
        o
        for o in kube.build(name)
        if not o["apiVersion"].startswith(("v1", "apps/", "batch/", "policy/", "autoscaling/", "networking.k8s.io/"))
    ]
    assert {o["kind"] for o in custom} <= {"ScaledObject", "TriggerAuthentication", "ServiceMonitor", "PodMonitor"}
    errors = [f"{o['kind']}/{o['metadata']['name']}: {e}" for o in custom for e in kube.crd_errors(o)]
    assert not errors, "\n".join(errors)


def test_the_vendored_crds_name_their_release() -> None:
    crds = kube.vendored_crds()
    assert set(crds) == {
        ("keda.sh/v1alpha1", "ScaledObject"),
        ("keda.sh/v1alpha1", "TriggerAuthentication"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("monitoring.coreos.com/v1", "PodMonitor"),
    }
    readme = (kube.CRDS / "README.md").read_text()
    for doc in crds.values():
        src = doc["source"]
        assert re.fullmatch(r"v\d+\.\d+\.\d+", src["tag"]) and re.fullmatch(r"[0-9a-f]{40}", src["commit"])
        assert src["tag"] in readme and src["path"] in readme


def test_the_schema_checks_have_teeth() -> None:
    """A misspelt field, a wrong type or a missing trigger would fail the checks above."""
    objects = kube.build("prod")
    worker = copy.deepcopy(kube.find(objects, "Deployment", "kvpool-worker"))
    kube.pod_spec(worker)["containers"][0]["imagePullPolice"] = "Always"
    assert kube.k8s_errors(worker, kube.K8S_VERSIONS[-1])
    worker = copy.deepcopy(kube.find(objects, "Deployment", "kvpool-worker"))
    kube.pod_spec(worker)["terminationGracePeriodSeconds"] = "ten minutes"
    assert kube.k8s_errors(worker, kube.K8S_VERSIONS[-1])

    scaled = copy.deepcopy(kube.find(objects, "ScaledObject", "kvpool-worker"))
    scaled["spec"]["minReplicas"] = 1
    assert any("minReplicas" in e for e in kube.crd_errors(scaled))
    scaled = copy.deepcopy(kube.find(objects, "ScaledObject", "kvpool-worker"))
    del scaled["spec"]["triggers"]
    assert any("triggers" in e for e in kube.crd_errors(scaled))
    monitor = copy.deepcopy(kube.find(objects, "PodMonitor", "kvpool-worker"))
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "often"
    assert kube.crd_errors(monitor)


# --------------------------------------------------------------------------- gateway


def test_the_gateway_is_a_service_with_a_disruption_budget_and_a_cpu_autoscaler(overlay) -> None:
    name, objects = overlay
    gateway = kube.find(objects, "Deployment", "kvpool-gateway")
    pods = gateway["spec"]["template"]["metadata"]["labels"]
    assert kube.labels_match(gateway["spec"]["selector"]["matchLabels"], pods)

    service = kube.find(objects, "Service", "kvpool-gateway")
    assert kube.labels_match(service["spec"]["selector"], pods)
    other_pods = [o for o in objects if o["kind"] in kube.WORKLOADS and o is not gateway]
    assert not any(kube.labels_match(service["spec"]["selector"], o["spec"]["template"]["metadata"]["labels"]) for o in other_pods)
    c = kube.container(gateway, "gateway")
    target = service["spec"]["ports"][0]["targetPort"]
    assert kube.named_port(c, target) == int(kube.kvpool_config(objects)["KVPOOL_PORT"])

    pdb = kube.find(objects, "PodDisruptionBudget", "kvpool-gateway")
    assert kube.labels_match(pdb["spec"]["selector"]["matchLabels"], pods) and pdb["spec"].get("maxUnavailable") == 1

    hpa = kube.find(objects, "HorizontalPodAutoscaler", "kvpool-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvpool-gateway"}
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert "cpu" in c["resources"]["requests"], "a CPU utilization target needs a CPU request"
    assert "replicas" not in gateway["spec"], "the autoscaler owns the replica count"
    if name in kube.ONE_OF_EVERYTHING:
        assert hpa["spec"]["minReplicas"] == hpa["spec"]["maxReplicas"] == 1
    else:
        assert hpa["spec"]["minReplicas"] >= 2


def test_the_gateway_drains_its_answers_before_it_stops(overlay) -> None:
    _, objects = overlay
    gateway = kube.find(objects, "Deployment", "kvpool-gateway")
    settings = kube.settings_from(kube.kvpool_config(objects))
    pause = int(kube.container(gateway, "gateway")["lifecycle"]["preStop"]["exec"]["command"][1])
    assert kube.pod_spec(gateway)["terminationGracePeriodSeconds"] >= settings.request_timeout_s + pause


# --------------------------------------------------------------------------- workers


def test_the_worker_grace_period_covers_the_job_timeout(overlay) -> None:
    """SIGTERM is a warm shutdown: the job in hand may run KVPOOL_JOB_TIMEOUT_S, and the worker then hands back its queue."""
    _, objects = overlay
    worker = kube.find(objects, "Deployment", "kvpool-worker")
    settings = kube.settings_from(kube.kvpool_config(objects))
    assert kube.pod_spec(worker)["terminationGracePeriodSeconds"] >= settings.job_timeout_s + 10


def test_worker_threads_come_from_the_cpu_limit(overlay) -> None:
    _, objects = overlay
    worker = kube.find(objects, "Deployment", "kvpool-worker")
    c = kube.container(worker, "worker")
    env = {e["name"]: e for e in c["env"]}
    for var in ("KVPOOL_N_THREADS", "KVPOOL_N_THREADS_BATCH"):
        ref = env[var]["valueFrom"]["resourceFieldRef"]
        assert ref == {"containerName": "worker", "resource": "limits.cpu", "divisor": "1"}, var
    assert "cpu" in c["resources"]["limits"], "without a CPU limit the downward API gives every core of the node"


def test_the_autoscaler_scales_the_worker_deployment_within_bounds(overlay) -> None:
    name, objects = overlay
    scaled = kube.find(objects, "ScaledObject", "kvpool-worker")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "kvpool-worker"
    assert "replicas" not in kube.find(objects, "Deployment", "kvpool-worker")["spec"], "KEDA owns the replica count"
    low, high = scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]
    assert 0 <= low <= high
    assert (low == 0) == (name == "scale-to-zero")
    if name in kube.ONE_OF_EVERYTHING:
        assert high == 1
    auth = scaled["spec"]["triggers"][0]["authenticationRef"]["name"]
    kube.find(objects, "TriggerAuthentication", auth)


def test_kvpool_is_not_pid_1(overlay) -> None:
    """PID 1 ignores a signal it has no handler for: a SIGTERM during start-up would wait out the grace period."""
    _, objects = overlay
    for name in ("kvpool-gateway", "kvpool-worker"):
        assert kube.pod_spec(kube.find(objects, "Deployment", name))["shareProcessNamespace"] is True


# --------------------------------------------------------------------------- the model


def test_an_init_container_fetches_the_model_from_the_bucket_with_its_checksum(overlay) -> None:
    _, objects = overlay
    config = kube.kvpool_config(objects)
    assert config["KVPOOL_MODEL"].startswith("s3://")
    assert re.fullmatch(r"[0-9a-f]{64}", config["KVPOOL_MODEL_SHA256"])
    state_dir = image_env(df.DEPLOY)["KVPOOL_STATE_DIR"]
    for name, role in (("kvpool-gateway", "gateway"), ("kvpool-worker", "worker")):
        workload = kube.find(objects, "Deployment", name)
        init = kube.container(workload, "model")
        main = kube.container(workload, role)
        assert init in kube.pod_spec(workload)["initContainers"]
        assert init["image"] == main["image"], "the project's own image and CLI fetch the model"
        assert init["args"] == ["model", "fetch", "--url", "$(KVPOOL_MODEL)", "--sha256", "$(KVPOOL_MODEL_SHA256)"]
        assert kube.config_data(objects, workload, init) == kube.config_data(objects, workload, main) == config
        mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
        assert mounts[state_dir] == {m["mountPath"]: m["name"] for m in main["volumeMounts"]}[state_dir], (
            "the worker must find the model where the init container put it"
        )


def test_the_model_fetch_the_init_container_runs_exists() -> None:
    import click

    from gateway.cli import main

    ctx = click.Context(main)
    fetch = main.get_command(ctx, "model").get_command(ctx, "fetch")  # type: ignore[union-attr]
    assert {"--url", "--sha256"} <= {opt for p in fetch.params for opt in p.opts}


def test_the_image_carries_no_weights() -> None:
    assert df.dockerignored("models/model.gguf", df.dockerignore_patterns())
    copied = [
        src for ins in df.parse_dockerfile(df.DOCKERFILE.read_text()) if ins.cmd in ("COPY", "ADD") for src in df.copy_sources(ins)[0]
    ]
    assert not [s for s in copied if s.endswith(".gguf") or "models" in s]


def test_the_dev_model_is_the_packaged_demo_model_put_in_minio() -> None:
    from worker.models.packaged import PACKAGED

    objects = kube.build("dev")
    config = kube.kvpool_config(objects)
    seed = kube.find(objects, "Job", "kvpool-seed-model")
    model = PACKAGED["smollm2"]
    assert config["KVPOOL_MODEL"].endswith("/" + model.filename) and config["KVPOOL_MODEL_SHA256"] == model.sha256
    assert kube.container(seed, "fetch")["args"][:4] == ["model", "fetch", "--name", "smollm2"]
    assert model.filename in kube.container(seed, "upload")["args"][0]


# --------------------------------------------------------------------------- state


def test_dev_runs_redis_with_aof_on_a_volume_claim_and_minio_in_the_cluster() -> None:
    objects = kube.build("dev")
    redis_set = kube.find(objects, "StatefulSet", "kvpool-redis")
    script = " ".join(kube.container(redis_set, "redis")["args"])
    assert "--appendonly yes" in script and "--maxmemory-policy noeviction" in script
    data_dir = re.search(r"--dir (\S+)", script).group(1)  # type: ignore[union-attr]
    claims = {t["metadata"]["name"] for t in redis_set["spec"]["volumeClaimTemplates"]}
    assert {m["name"] for m in kube.container(redis_set, "redis")["volumeMounts"] if m["mountPath"] == data_dir} <= claims
    assert claims

    minio = kube.find(objects, "StatefulSet", "kvpool-minio")
    assert minio["spec"]["volumeClaimTemplates"]
    endpoint = kube.kvpool_config(objects)["KVPOOL_S3_ENDPOINT_URL"]
    service = kube.find(objects, "Service", "kvpool-minio")
    assert endpoint == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    kube.find(objects, "Job", "kvpool-createbucket")
    for o in objects:
        if o["kind"] in kube.WORKLOADS and o["kind"] != "Job":
            assert o["spec"].get("replicas", 1) == 1, f"dev runs one of everything: {o['metadata']['name']}"


@pytest.mark.parametrize("name", kube.EXTERNAL_STATE)
def test_prod_brings_no_redis_and_no_s3_of_its_own(name: str) -> None:
    objects = kube.build(name)
    assert not kube.of_kind(objects, "StatefulSet") and not kube.of_kind(objects, "Job")
    config = kube.kvpool_config(objects)
    assert "kvpool-minio" not in config.get("KVPOOL_S3_ENDPOINT_URL", "")


# --------------------------------------------------------------------------- overlays


@pytest.mark.parametrize("name", kube.EXTERNAL_STATE)
def test_prod_gives_every_container_requests_and_limits(name: str) -> None:
    for workload, c in kube.all_containers(kube.build(name)):
        res = c.get("resources", {})
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res.get(part, {})), f"{workload['metadata']['name']}/{c['name']} has no {part}"
    worker = kube.container(kube.find(kube.build(name), "Deployment", "kvpool-worker"), "worker")
    assert worker["resources"]["requests"]["cpu"] == worker["resources"]["limits"]["cpu"], "threads = limit, on cores of its own"


@pytest.mark.parametrize("name", kube.EXTERNAL_STATE)
def test_prod_spreads_workers_across_nodes(name: str) -> None:
    worker = kube.find(kube.build(name), "Deployment", "kvpool-worker")
    pods = worker["spec"]["template"]["metadata"]["labels"]
    spec = kube.pod_spec(worker)
    terms = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert any(
        t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        and kube.labels_match(t["podAffinityTerm"]["labelSelector"]["matchLabels"], pods)
        for t in terms
    )
    assert any(t["topologyKey"] == "kubernetes.io/hostname" for t in spec["topologySpreadConstraints"])


def _allows(policy: dict[str, Any], direction: str) -> list[dict[str, Any]]:
    return policy["spec"].get(direction, []) if direction.capitalize() in policy["spec"]["policyTypes"] else []


def _selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    sel = policy["spec"]["podSelector"]
    if not kube.labels_match(sel.get("matchLabels", {}), labels):
        return False
    return all((labels.get(e["key"]) in e["values"]) == (e["operator"] == "In") for e in sel.get("matchExpressions", []))


@pytest.mark.parametrize("name", kube.EXTERNAL_STATE)
def test_prod_network_policies_open_only_the_gateway_and_only_to_redis_and_s3_for_kvpool(name: str) -> None:
    objects = kube.build(name)
    policies = kube.of_kind(objects, "NetworkPolicy")
    gateway = kube.find(objects, "Deployment", "kvpool-gateway")["spec"]["template"]["metadata"]["labels"]
    worker = kube.find(objects, "Deployment", "kvpool-worker")["spec"]["template"]["metadata"]["labels"]
    stranger = {"app.kubernetes.io/name": "something-else"}
    for pod in (gateway, worker, stranger):
        assert any(_selects(p, pod) and {"Ingress", "Egress"} <= set(p["spec"]["policyTypes"]) for p in policies), "default deny"

    def ingress(pod: dict[str, str]) -> list[dict[str, Any]]:
        return [rule for p in policies if _selects(p, pod) for rule in _allows(p, "ingress")]

    def egress_ports(pod: dict[str, str]) -> set[int]:
        return {port["port"] for p in policies if _selects(p, pod) for rule in _allows(p, "egress") for port in rule.get("ports", [])}

    config = kube.kvpool_config(objects)
    assert [r for r in ingress(gateway) if "from" not in r] and {p["port"] for r in ingress(gateway) for p in r["ports"]} == {
        int(config["KVPOOL_PORT"])
    }
    assert all("from" in r for r in ingress(worker)), "workers are reached by Prometheus only"
    assert not ingress(stranger)
    redis_and_s3 = {6379, 443}
    assert redis_and_s3 <= egress_ports(gateway) and redis_and_s3 <= egress_ports(worker)
    assert egress_ports(stranger) == {53}, "other pods of the namespace reach DNS, nothing else"


def test_scale_to_zero_lets_the_gateway_queue_for_workers_that_are_not_there_yet() -> None:
    objects = kube.build("scale-to-zero")
    assert kube.find(objects, "ScaledObject", "kvpool-worker")["spec"]["minReplicaCount"] == 0
    assert kube.settings_from(kube.kvpool_config(objects)).queue_without_workers is True
    for name in ("dev", "prod"):
        assert kube.settings_from(kube.kvpool_config(kube.build(name))).queue_without_workers is False


def test_gpu_workers_ask_for_a_gpu_and_offload_the_layers() -> None:
    objects = kube.build("gpu")
    worker = kube.find(objects, "Deployment", "kvpool-worker")
    assert kube.container(worker, "worker")["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in kube.pod_spec(worker)["tolerations"])
    assert kube.settings_from(kube.kvpool_config(objects)).n_gpu_layers > 0
    assert kube.settings_from(kube.kvpool_config(kube.build("prod"))).n_gpu_layers == 0


def test_the_readme_has_a_command_for_each_overlay() -> None:
    readme = (df.DEPLOY / "README.md").read_text()
    section = readme[readme.index("## Kubernetes") :]
    for name in kube.OVERLAYS:
        assert f"kubectl apply -k deploy/kubernetes/overlays/{name}" in section, name

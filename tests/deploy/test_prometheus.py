"""deploy/prometheus.yml: valid for promtool, and scraping the compose services on the ports kvpool listens on."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import deployfiles as df
from tests.deploy.deployfiles import promtool


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return yaml.safe_load(df.PROMETHEUS_FILE.read_text())


@pytest.fixture(scope="module")
def jobs(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    names = [j["job_name"] for j in config["scrape_configs"]]
    assert len(names) == len(set(names)), f"duplicate job names: {names}"
    return {j["job_name"]: j for j in config["scrape_configs"]}


def test_promtool_check_config() -> None:
    r = subprocess.run([promtool(), "check", "config", str(df.PROMETHEUS_FILE)], check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"promtool check config failed:\n{r.stdout}{r.stderr}"


def test_promtool_rejects_a_broken_config(tmp_path: Path) -> None:
    """The check above has teeth."""
    bad = tmp_path / "prometheus.yml"
    bad.write_text(df.PROMETHEUS_FILE.read_text().replace("dns_sd_configs:", "dns_sd_config:", 1))
    r = subprocess.run([promtool(), "check", "config", str(bad)], check=False, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0


def test_gateway_is_scraped_on_its_port(jobs: dict[str, dict[str, Any]]) -> None:
    services = df.compose()["services"]
    port = df.environment(services["gateway"])["KVPOOL_PORT"]
    targets = [t for sc in jobs["gateway"]["static_configs"] for t in sc["targets"]]
    assert targets == [f"gateway:{port}"]
    assert jobs["gateway"].get("metrics_path", "/metrics") == "/metrics"


def test_every_worker_is_scraped(jobs: dict[str, dict[str, Any]]) -> None:
    """Through DNS service discovery of the `worker` service, so that `--scale worker=N` needs no config change."""
    services = df.compose()["services"]
    port = int(df.environment(services["worker"])["KVPOOL_METRICS_PORT"])
    job = jobs["worker"]
    assert "static_configs" not in job, "a static worker list misses scaled replicas"
    (sd,) = job["dns_sd_configs"]
    assert sd.get("type", "SRV") == "A", "compose's DNS answers A records"
    assert sd["port"] == port
    assert "worker" in sd["names"] and set(sd["names"]) <= {"worker", "tasks.worker"}


def test_static_targets_are_compose_services(jobs: dict[str, dict[str, Any]]) -> None:
    services = df.compose()["services"]
    container_ports = {
        name: {df.parse_port(p)[2] for p in s.get("ports", [])} | {str(p) for p in s.get("expose", [])} for name, s in services.items()
    }
    for name, job in jobs.items():
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host, _, port = target.rpartition(":")
                if host == "localhost" and name == "prometheus":
                    continue
                assert host in services, f"job {name}: {host} is not a compose service"
                assert port in container_ports[host], f"job {name}: {host} does not listen on {port} ({container_ports[host]})"


def test_minio_metrics_are_public_if_scraped(jobs: dict[str, dict[str, Any]]) -> None:
    if "minio" in jobs:
        env = df.environment(df.compose()["services"]["minio"])
        assert env.get("MINIO_PROMETHEUS_AUTH_TYPE") == "public", "MinIO wants a bearer token for /minio/v2/metrics unless told otherwise"

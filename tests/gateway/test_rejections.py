"""What a refused request leaves behind: one log line naming why, and metrics whose labels stay a bounded set.

A real ``kvpool gateway`` process (no worker: each request here is refused before it would reach one).
"""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import MODEL, poll


def _line_with(log: Path, needle: str) -> str:
    found: list[str] = []

    def seen() -> bool:
        found[:] = [line for line in log.read_text().splitlines() if needle in line]
        return bool(found)

    poll(seen, f"a log line with {needle}", timeout_s=10)
    return found[0]


def test_every_refused_request_is_logged_with_its_id_status_type_and_field(start_gateway, tmp_path: Path) -> None:
    g = start_gateway()
    model = MODEL  # the pool's model (no worker is live, so /v1/models answers 503 here)

    r = httpx.post(g.url + "/v1/chat/completions", json={"model": model, "messages": []})
    assert r.status_code == 400
    line = _line_with(Path(g.log_path), r.headers["x-request-id"])
    assert "request.rejected" in line and "status=400" in line and "error_type=invalid_request_error" in line
    assert "field=messages" in line and "endpoint=/v1/chat/completions" in line

    body = {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]}
    r = httpx.post(g.url + "/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["type"] == "error"
    line = _line_with(Path(g.log_path), r.headers["x-request-id"])
    assert "request.rejected" in line and "field=tools.0.input_schema" in line and "endpoint=/v1/messages" in line

    r = httpx.post(g.url + "/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    line = _line_with(Path(g.log_path), r.headers["x-request-id"])
    assert "status=404" in line and "field=model" in line


def test_metric_labels_are_route_templates_not_paths(start_gateway) -> None:
    g = start_gateway()
    for i in range(3):
        assert httpx.get(f"{g.url}/v1/responses/resp_{i}x/input_items").status_code == 404
        assert httpx.get(f"{g.url}/v1/responses/resp_{i}y").status_code == 404
        assert httpx.get(f"{g.url}/no/such/path/{i}").status_code == 404
    endpoints = {
        s.labels["endpoint"]
        for family in text_string_to_metric_families(httpx.get(g.url + "/metrics").text)
        for s in family.samples
        if s.name == "kvpool_gateway_requests_total"
    }
    assert {"/v1/responses/{response_id}/input_items", "/v1/responses/{response_id}", "unmatched"} <= endpoints
    assert not [e for e in endpoints if "resp_" in e or e.startswith("/no/")], endpoints

"""The background publisher never holds up a job: when tasks pile up past its bound, new ones are dropped and counted."""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY

from store.chain import CacheFormat, Namespace
from store.store import Store
from worker.publisher import Publisher

NS = Namespace("fp", CacheFormat.of("f16", "f16", False), chunk_size=4)
LABELS = {"model": "test-publisher", "layout": "f16"}


def _dropped() -> float:
    return REGISTRY.get_sample_value("kvpool_worker_publish_errors_total", {**LABELS, "reason": "queue_full"}) or 0.0


def test_a_full_queue_drops_new_tasks_and_says_so(store: Store) -> None:
    publisher = Publisher(store, max_pending=1, labels=LABELS)
    release, running = threading.Event(), threading.Event()
    done: list[str] = []

    def hold() -> None:  # runs on the publisher's thread once its task is over: it stays busy until released
        running.set()
        release.wait(10)
        done.append("first")

    before = _dropped()
    try:
        assert publisher.submit(NS, [1, 2, 3, 4], [], b"not a state", on_done=hold)
        assert running.wait(10)
        assert publisher.submit(NS, [1, 2, 3, 4], [], b"not a state", on_done=lambda: done.append("second")), "one waits in the queue"
        assert not publisher.submit(NS, [1, 2, 3, 4], [], b"not a state", on_done=lambda: done.append("dropped")), "the queue is full"
        assert done == ["dropped"], "a dropped task's on_done runs at once (its leases are released)"
        assert _dropped() == before + 1
    finally:
        release.set()
        assert publisher.wait_idle(10)
        publisher.close()
    assert done == ["dropped", "first", "second"]

"""Routing and admission as plain functions: where a job goes, and when a request is refused rather than left to rot."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue

from gateway.dispatch import Dispatcher, JobTime, Route, choose, expected_finish_s
from gateway.pool.procs import RedisServer
from gateway.settings import GatewaySettings
from store.chain import CacheFormat, Namespace
from store.index import RedisIndex
from tests.redis_faults import ReplyLosingProxy
from worker.advert import Advert, Serving, advertise, withdraw
from worker.protocol import JobSpec, job_spec


def _ad(name: str, keys: list[str], busy: bool = False, layout: str = "") -> Advert:
    return Advert(name, tuple(keys), busy, 0.0, layout=layout)


def test_a_request_goes_to_the_free_worker_holding_the_deepest_prefix() -> None:
    route = choose([_ad("a", ["k1"]), _ad("b", ["k1", "k2"])], ["k1", "k2", "k3"], {}, "shared", 0)
    assert (route.queue, route.reason, route.depth) == ("kvpool:worker:b", "locality", 2)


def test_a_busy_holder_or_no_holder_means_the_shared_queue() -> None:
    assert choose([_ad("b", ["k1"], busy=True)], ["k1"], {}, "shared", 0).reason == "holder_busy"
    assert choose([_ad("b", ["x"])], ["k1"], {}, "shared", 0).reason == "no_holder"
    assert choose([_ad("b", ["k1"])], ["k1"], {"b": 1}, "shared", 0).queue == "shared"


def test_in_a_mixed_pool_a_request_goes_to_a_worker_that_can_restore_the_deepest_stored_chunks() -> None:
    ads = [_ad("avx512", [], layout="L512"), _ad("avx2-a", [], busy=True, layout="L2"), _ad("avx2-b", [], layout="L2")]
    route = choose(ads, ["k1", "k2", "k3"], {}, "shared", 0, {"L512": 0, "L2": 3})
    assert (route.queue, route.reason, route.worker, route.depth) == ("kvpool:worker:avx2-b", "store_layout", "avx2-b", 3)


def test_a_context_at_least_as_deep_as_the_store_still_wins() -> None:
    ads = [_ad("a", ["k1", "k2"], layout="L1"), _ad("b", [], layout="L2")]
    assert choose(ads, ["k1", "k2", "k3"], {}, "shared", 0, {"L1": 0, "L2": 2}).reason == "locality"
    assert choose(ads, ["k1", "k2", "k3"], {}, "shared", 0, {"L1": 0, "L2": 3}).worker == "b"


def test_layouts_that_hold_as_much_or_busy_workers_of_the_deepest_leave_the_shared_queue() -> None:
    ads = [_ad("a", [], layout="L1"), _ad("b", [], layout="L2", busy=True)]
    assert choose(ads, ["k1", "k2"], {}, "shared", 0, {"L1": 2, "L2": 2}).reason == "no_holder"
    busy = choose(ads, ["k1", "k2"], {}, "shared", 0, {"L1": 0, "L2": 2})
    assert (busy.queue, busy.reason) == ("shared", "store_layout_busy")
    assert choose(ads, ["k1", "k2"], {"a": 1}, "shared", 0, {"L1": 2, "L2": 0}).reason == "store_layout_busy"


def test_the_expected_finish_shares_the_queue_among_the_workers() -> None:
    assert expected_finish_s(0, 2, 3.0) == 3.0
    assert expected_finish_s(10, 2, 3.0) == 18.0
    assert expected_finish_s(10, 2, None) is None and expected_finish_s(3, 0, 1.0) is None


def test_job_time_is_a_weighted_mean_of_recent_jobs() -> None:
    t = JobTime(weight=0.5)
    assert t.mean is None
    t.observe(4.0)
    t.observe(2.0)
    assert t.mean == 3.0


def test_the_dispatcher_reads_from_the_index_which_live_layout_holds_the_prompt_deepest(redis_url: str) -> None:
    """Real Redis: two workers of other kernels advertise; the index holds five chunks of the prompt in one's namespace."""
    conn = redis.Redis.from_url(redis_url)
    layouts = {name: CacheFormat.of("f16", "f16", False, {"kernels": name}) for name in ("avx512", "avx2")}
    for name, layout in layouts.items():
        advertise(conn, name, [], False, serving=Serving("model-fp", 4, layout.canonical(), f"cpu={name}"))
    spec = job_spec(list(range(1, 40)), model="model-fp", chunk_size=4, tenant_salt="salt")
    ns = Namespace("model-fp", layouts["avx2"], 4, "salt")  # as the avx2 worker roots its blob chain
    index = RedisIndex(conn)
    for i, key in enumerate(ns.chain(spec.tokens)[:5]):
        index.add(key, ns.key, i, 100)
    dispatcher = Dispatcher(conn, GatewaySettings())

    _, route = dispatcher.dispatch(spec)
    assert (route.reason, route.worker, route.depth) == ("store_layout", "avx2", 5)
    _, other_tenant = dispatcher.dispatch(spec.model_copy(update={"tenant_salt": "other"}))
    assert other_tenant.reason == "no_holder", "another tenant's namespace holds nothing"
    withdraw(conn, "avx512")
    assert dispatcher.dispatch(spec)[1].reason == "no_holder", "one layout in the pool: every worker restores as deep"


def test_a_request_admitted_while_redis_restarts_is_enqueued_once_it_is_back(tmp_path: Path) -> None:
    """Redis refuses connections for about a second when it restarts: `dispatch` waits for it (up to
    ``redis_outage_s``) instead of failing the request."""
    server = RedisServer(tmp_path / "redis").start()
    conn = redis.Redis(port=server.port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    settings = GatewaySettings(redis_url=server.url, queue_without_workers=True, redis_outage_s=30)
    dispatcher = Dispatcher(conn, settings)
    tried_while_down = threading.Event()

    class Note(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            tried_while_down.set()

    note = Note()
    logging.getLogger("kvpool.redis").addHandler(note)
    server.stop()
    out: list[tuple[str, Route]] = []
    spec = JobSpec(tokens=[1, 2, 3], chain=[], chunk_size=4, model="m", enqueued_at=0.0)
    t = threading.Thread(target=lambda: out.append(dispatcher.dispatch(spec)), daemon=True)
    t.start()
    try:
        assert tried_while_down.wait(30), "dispatch never found Redis down"
        server = RedisServer(tmp_path / "redis", port=server.port).start()
        t.join(30)
        assert len(out) == 1, "answered once Redis was back"
        job_id, route = out[0]
        assert route.queue == settings.queue and job_id in Queue(settings.queue, connection=conn).get_job_ids()
    finally:
        logging.getLogger("kvpool.redis").removeHandler(note)
        server.stop()


def test_a_redis_outage_longer_than_redis_outage_s_is_an_error(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    conn = redis.Redis(port=server.port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    dispatcher = Dispatcher(conn, GatewaySettings(redis_url=server.url, queue_without_workers=True, redis_outage_s=0.3))
    server.stop()
    with pytest.raises(redis.ConnectionError):
        dispatcher.dispatch(JobSpec(tokens=[1, 2, 3], chain=[], chunk_size=4, model="m", enqueued_at=0.0))


def test_a_prompt_cache_key_routes_to_one_worker_while_nobody_holds_the_prefix() -> None:
    ads = [_ad(n, ["x"], busy=(n == "w2")) for n in ("w1", "w2", "w3", "w4")]
    keyed = {choose(ads, ["k1"], {}, "shared", 0, route_key=f"key-{i}", key_max_queue=8).worker for i in range(40)}
    assert keyed == {"w1", "w2", "w3", "w4"}  # keys spread over the workers, busy or not
    route = choose(ads, ["k1"], {}, "shared", 0, route_key="key-7", key_max_queue=8)
    assert route.reason == "cache_key" and route.queue == f"kvpool:worker:{route.worker}"
    assert (
        choose(list(reversed(ads)), ["k1"], {}, "shared", 0, route_key="key-7", key_max_queue=8) == route
    )  # whatever the order of the adverts
    rest = [a for a in ads if a.worker != "w3"]
    for i in range(40):  # a worker leaving moves only the keys it had
        before, after = (choose(x, ["k1"], {}, "shared", 0, route_key=f"key-{i}", key_max_queue=8).worker for x in (ads, rest))
        assert after == before or before == "w3"
    assert choose(ads, ["k1"], {route.worker: 9}, "shared", 0, route_key="key-7", key_max_queue=8).reason == "cache_key_busy"
    assert choose(ads, ["k1"], {}, "shared", 0).reason == "no_holder"


def test_a_holder_wins_over_the_prompt_cache_key() -> None:
    route = choose([_ad("w1", []), _ad("w2", ["k1"])], ["k1", "k2"], {}, "shared", 0, route_key="any-key", key_max_queue=8)
    assert (route.reason, route.worker) == ("locality", "w2")


@pytest.mark.parametrize("job_id", [None, "given-id"])
def test_an_enqueue_redis_ran_but_never_answered_is_not_enqueued_again(redis_url: str, job_id: str | None) -> None:
    """Redis ran the enqueue's transaction and the reply was lost: the retry finds the job instead of pushing it a second time."""
    admin = redis.Redis.from_url(redis_url)
    queue = f"kvpool:lost-reply-{job_id}"
    settings = GatewaySettings(redis_url=redis_url, queue=queue, queue_without_workers=True, redis_outage_s=30)
    with ReplyLosingProxy(urlsplit(redis_url).port or 6379) as proxy:
        conn = redis.Redis(host="127.0.0.1", port=proxy.port, retry=Retry(NoBackoff(), 0))
        dispatcher = Dispatcher(conn, settings)
        proxy.only_with = b"$5\r\nRPUSH\r\n"  # RQ's enqueue: the job's hash and its id pushed on the queue, one transaction
        proxy.armed.set()
        got, route = dispatcher.dispatch(JobSpec(tokens=[1, 2, 3], chain=[], chunk_size=4, model="m", enqueued_at=0.0), job_id=job_id)
        assert proxy.lost.is_set(), "the enqueue's reply never reached the dispatcher"
    assert job_id in (None, got)
    assert route.queue == queue
    assert Queue(queue, connection=admin).get_job_ids() == [got], "the job is queued once, and no other job beside it"

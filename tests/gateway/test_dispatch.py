"""Routing and admission as plain functions: where a job goes, and when a request is refused rather than left to rot."""

from __future__ import annotations

from gateway.dispatch import JobTime, choose, expected_finish_s
from worker.advert import Advert


def _ad(name: str, keys: list[str], busy: bool = False) -> Advert:
    return Advert(name, tuple(keys), busy, 0.0)


def test_a_request_goes_to_the_free_worker_holding_the_deepest_prefix() -> None:
    route = choose([_ad("a", ["k1"]), _ad("b", ["k1", "k2"])], ["k1", "k2", "k3"], {}, "shared", 0)
    assert (route.queue, route.reason, route.depth) == ("kvpool:worker:b", "locality", 2)


def test_a_busy_holder_or_no_holder_means_the_shared_queue() -> None:
    assert choose([_ad("b", ["k1"], busy=True)], ["k1"], {}, "shared", 0).reason == "holder_busy"
    assert choose([_ad("b", ["x"])], ["k1"], {}, "shared", 0).reason == "no_holder"
    assert choose([_ad("b", ["k1"])], ["k1"], {"b": 1}, "shared", 0).queue == "shared"


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


def test_a_prompt_cache_key_routes_to_one_worker_while_nobody_holds_the_prefix() -> None:
    ads = [_ad(n, ["x"], busy=(n == "w2")) for n in ("w1", "w2", "w3", "w4")]
    keyed = {choose(ads, ["k1"], {}, "shared", 0, f"key-{i}", 8).worker for i in range(40)}
    assert keyed == {"w1", "w2", "w3", "w4"}  # keys spread over the workers, busy or not
    route = choose(ads, ["k1"], {}, "shared", 0, "key-7", 8)
    assert route.reason == "cache_key" and route.queue == f"kvpool:worker:{route.worker}"
    assert choose(list(reversed(ads)), ["k1"], {}, "shared", 0, "key-7", 8) == route  # whatever the order of the adverts
    rest = [a for a in ads if a.worker != "w3"]
    for i in range(40):  # a worker leaving moves only the keys it had
        before, after = (choose(x, ["k1"], {}, "shared", 0, f"key-{i}", 8).worker for x in (ads, rest))
        assert after == before or before == "w3"
    assert choose(ads, ["k1"], {route.worker: 9}, "shared", 0, "key-7", 8).reason == "cache_key_busy"
    assert choose(ads, ["k1"], {}, "shared", 0).reason == "no_holder"


def test_a_holder_wins_over_the_prompt_cache_key() -> None:
    route = choose([_ad("w1", []), _ad("w2", ["k1"])], ["k1", "k2"], {}, "shared", 0, "any-key", 8)
    assert (route.reason, route.worker) == ("locality", "w2")

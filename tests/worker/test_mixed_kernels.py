"""A pool whose workers run other kernels: each restores only what identical kernels computed, unless told to share.

One machine has one CPU, but llama.cpp has kernel switches of its own: with
``GGML_CPU_TILED_MM_FORCE=1`` its CPU backend takes the tiled matrix multiplication for
the K-quant products it would otherwise leave to the default kernels, and computes other
bits (on the tiny model quantized to Q4_K_M, the logits move in their last bits). So two
real worker processes here run two kinds of kernels, as an AVX-512 and an AVX2-only host
do, and nothing in the test declares a fingerprint: each worker reads its own from the
library it loaded. (`deploy/mixed-fleet-check.sh` does the same with a second build.)
"""

from __future__ import annotations

import ctypes
import json
import urllib.request
from pathlib import Path

import llama_cpp
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.pool.procs import free_port
from store.store import Store
from tests.helpers import POOL_CHUNK, THREADS, PoolClient, cold_greedy, prompt_text, wait_settled
from worker.advert import adverts
from worker.engine.context import flash_attn_for

pytestmark = pytest.mark.fp_path  # answers are compared bit for bit

FORCED = {"GGML_CPU_TILED_MM_FORCE": "1"}
SHARE = {"KVPOOL_SHARE_ACROSS_KERNELS": "true"}


@pytest.fixture(scope="session")
def q4k_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model quantized to Q4_K_M by llama.cpp's own quantizer (K-quants are what the tiled kernels take)."""
    out = tmp_path_factory.mktemp("q4k") / "tiny-q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 1
    assert llama_cpp.llama_model_quantize(str(tiny_model).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


@pytest.fixture
def q4k_client(redis_url: str, q4k_model: Path) -> PoolClient:
    return PoolClient(redis.Redis.from_url(redis_url), q4k_model)


def fresh(client: PoolClient, worker: str, tokens: list[int], **kw: object):  # type: ignore[no-untyped-def]
    """Ask ``worker`` from an empty context (a job of another tenant first), so any reuse comes from the store."""
    client.run([5, 6, 7], worker=worker, tenant="elsewhere", max_tokens=1)
    return client.run(tokens, worker=worker, logprobs=5, **kw)


def test_workers_of_other_kernels_never_restore_each_others_chunks(start_worker, q4k_client, q4k_model, redis_url, store_settings_s3):
    port = free_port()
    start_worker("plain", KVPOOL_MODEL=str(q4k_model))
    start_worker("forced", KVPOOL_MODEL=str(q4k_model), KVPOOL_METRICS_PORT=str(port), **FORCED)
    ads = {a.worker: a for a in adverts(q4k_client.conn)}
    assert "tiled_mm_force=on" in ads["forced"].kernels and "tiled_mm_force" not in ads["plain"].kernels
    assert ads["plain"].layout != ads["forced"].layout, "the kernels' digest is part of the layout, so of the blob namespace"

    prompt = q4k_client.tokens(prompt_text(70, 12 * POOL_CHUNK))
    plain = fresh(q4k_client, "plain", prompt)
    cold = llama_cpp.Llama(
        str(q4k_model), n_ctx=2048, n_threads=1, n_threads_batch=THREADS, verbose=False, flash_attn=flash_attn_for(q4k_model, None)
    )  # this process runs the default kernels
    assert plain.tokens == cold_greedy(cold, prompt, 24)
    wait_settled(redis_url)

    forced = fresh(q4k_client, "forced", prompt)
    assert forced.usage.cached_from_store == 0, "nothing restored of what the other kernels computed"
    assert forced.logprobs != plain.logprobs, "the two kinds of kernels compute other bits: sharing would change answers"
    wait_settled(redis_url)

    for worker, first in (("plain", plain), ("forced", forced)):
        again = fresh(q4k_client, worker, prompt)
        assert again.usage.cached_from_store >= len(prompt) - 2, f"{worker} restores what its own kind published"
        assert (again.tokens, again.logprobs) == (first.tokens, first.logprobs), f"{worker}: the cold answer, to the bit"

    with Store.open(store_settings_s3) as store:
        split = store.stats()["bytes_by_kernels"]
    assert set(split) == {ads["plain"].kernels, ads["forced"].kernels} and all(n > 0 for n in split.values())  # type: ignore[union-attr]

    ready = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5).read())
    assert ready["kernels"] == ads["forced"].kernels and ready["share_across_kernels"] == "false"
    assert ready["layout"] == ads["forced"].layout
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    info = next(s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "kvpool_worker_info")
    assert info.labels["kernels"] == ads["forced"].kernels


def test_sharing_across_kernels_restores_more_and_may_change_the_bits_but_never_reaches_exact_workers(
    start_worker, q4k_client, q4k_model, redis_url
):
    start_worker("plain-shared", KVPOOL_MODEL=str(q4k_model), **SHARE)
    start_worker("forced-shared", KVPOOL_MODEL=str(q4k_model), **SHARE, **FORCED)
    start_worker("plain-exact", KVPOOL_MODEL=str(q4k_model))
    prompt = q4k_client.tokens(prompt_text(71, 12 * POOL_CHUNK))

    forced_cold = fresh(q4k_client, "forced-shared", prompt, tenant="cold")  # another tenant: nothing stored to restore
    assert forced_cold.usage.cached_from_store == 0
    plain = fresh(q4k_client, "plain-shared", prompt)
    wait_settled(redis_url)

    forced = fresh(q4k_client, "forced-shared", prompt)
    assert forced.usage.cached_from_store >= len(prompt) - 2, "shared: restored what the other kernels computed"
    assert forced.logprobs != forced_cold.logprobs, "and the answer's bits are no longer the cold run's"

    exact = fresh(q4k_client, "plain-exact", prompt)
    assert exact.usage.cached_from_store == 0, "an exact worker never restores chunks of the shared namespace"
    assert (exact.tokens, exact.logprobs) == (plain.tokens, plain.logprobs), "same kernels, both cold: the same bits"

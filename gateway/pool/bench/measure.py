"""Measurements besides the systems' samples: the physical floor's parts, bytes per token, hashing, the machine.

The physical floor of a cross-worker hit is what any design must pay at least: move
the prefix's KV bytes from the store at the endpoint's raw GET bandwidth (measured
here with objects of the stored blob size, fetched in parallel like a worker does, but
with nothing else: no index, no checks, no restore), then evaluate the suffix on top
of the prefix (measured in process on a context that already holds the prefix).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llama_cpp
import numpy as np
import redis

from store.backends import open_backend
from store.blob import header_size
from store.chain import Namespace
from store.errors import StoreError
from store.index import RedisIndex
from store.settings import StoreSettings
from worker.engine.kvcache import ContextCache

RAW_PREFIX = "bench-raw/"


def pct(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), None for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


class RawGetProbe:
    """GET bandwidth of the store endpoint itself, for objects of one size, fetched ``threads`` at a time."""

    def __init__(self, settings: StoreSettings, object_bytes: int, n_objects: int, threads: int) -> None:
        self.backend = open_backend(settings)
        self.object_bytes = object_bytes
        self.names = [f"{RAW_PREFIX}{object_bytes}/{i}" for i in range(n_objects)]
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bench-raw-get")
        self.samples: list[float] = []
        payload = np.random.default_rng(0).bytes(object_bytes)
        for name in self.names:
            self.backend.put(name, payload)

    def measure(self) -> float:
        """One parallel GET of every object; returns and records bytes per second."""
        t0 = time.perf_counter()
        total = sum(len(b) for b in self.pool.map(self.backend.get, self.names))
        bw = total / (time.perf_counter() - t0)
        self.samples.append(bw)
        return bw

    def close(self) -> None:
        self.pool.shutdown()
        for name in self.names:
            try:
                self.backend.delete(name)
            except StoreError:
                pass  # scratch objects; the run's store goes away with its services


def stored_bytes(index: RedisIndex, ns: Namespace) -> list[int]:
    """Sizes of the full-chunk blobs indexed under one namespace (a tail holds fewer tokens than a chunk)."""
    return [e.size for e in index.entries() if e.namespace == ns.key and not e.tail]


def bytes_per_token(blob_sizes: Sequence[int], chunk_size: int, kv: ContextCache) -> dict[str, object]:
    """Stored bytes per token against the K and V rows alone (what a perfect store would keep)."""
    layout = kv.state_layout
    theoretical = layout.bytes_per_token - layout.cell_meta_bytes
    stored = statistics.mean(blob_sizes) / chunk_size if blob_sizes else None
    return {
        "chunks": len(blob_sizes),
        "chunk_size": chunk_size,
        "theoretical_kv_bytes_per_token": theoretical,
        "stored_bytes_per_token": stored,
        "ratio": stored / theoretical if stored else None,
        "overhead_per_token": {
            "cell_metadata": layout.cell_meta_bytes,
            "payload_header": layout.header_bytes / chunk_size,
            "blob_header": header_size(chunk_size) / chunk_size,
        },
        "layout": {
            "n_layer": kv.n_layer,
            "n_embd_k_gqa": kv.n_embd_k_gqa,
            "n_embd_v_gqa": kv.n_embd_v_gqa,
            "type_k": kv.type_k,
            "type_v": kv.type_v,
        },
    }


def hashing_and_lookup(conn: redis.Redis[bytes], ns: Namespace, n_tokens: int = 32768, reps: int = 50, seed: int = 0) -> dict[str, object]:
    """Chain hashing of an ``n_tokens`` prompt (a list of ints, as jobs carry) and one index lookup of its keys.

    The keys are indexed first (under a scratch prefix of the same Redis) so that the
    lookup walks the whole chain, as a full hit does.
    """
    tokens = [int(t) for t in np.random.default_rng(seed).integers(3, 30000, n_tokens)]
    index = RedisIndex(conn, prefix="kvpool:bench-scratch:")
    keys = ns.chain(tokens)
    for i, k in enumerate(keys):
        index.add(k, ns.key, i, 1)
    hash_s, lookup_s, total_s = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        keys = ns.chain(tokens)
        t1 = time.perf_counter()
        depth = index.deepest(keys)
        t2 = time.perf_counter()
        hash_s.append(t1 - t0)
        lookup_s.append(t2 - t1)
        total_s.append(t2 - t0)
    assert depth == len(keys)
    index.clear()
    return {
        "tokens": n_tokens,
        "chunk_size": ns.chunk_size,
        "chunks": len(keys),
        "reps": reps,
        "hash_p50_s": pct(hash_s, 50),
        "lookup_p50_s": pct(lookup_s, 50),
        "total_p50_s": pct(total_s, 50),
        "total_p95_s": pct(total_s, 95),
    }


def calibrate(llm: llama_cpp.Llama, pool: np.ndarray, bos: int, n_prompt: int = 128, tries: int = 2) -> dict[str, float]:
    """Prompt tokens per second and seconds per generated token, to estimate a run's duration up front.

    The best of ``tries``: a neighbour's burst should not inflate the estimate of a whole run.
    """
    rng = np.random.default_rng(1)
    tokens = [bos] + [int(t) for t in rng.choice(pool, n_prompt - 1)]
    llm.reset()
    llm.eval(tokens[:16])  # first touch of the weights
    prompt_s, decode_s = float("inf"), float("inf")
    for _ in range(tries):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(tokens)
        prompt_s = min(prompt_s, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in tokens[1:5]:
            llm.eval([t])
        decode_s = min(decode_s, (time.perf_counter() - t0) / 4)
    llm.reset()
    return {"prompt_tokens_per_s": n_prompt / prompt_s, "decode_s_per_token": decode_s}


def machine() -> dict[str, object]:
    """What the numbers were measured on."""
    cpu = platform.processor() or ""
    mem_gb = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = round(int(line.split()[1]) / 1024**2, 1)
                break
    except OSError:
        pass
    affinity: int | None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    info = llama_cpp.llama_print_system_info()
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "usable_cpus": affinity,
        "memory_gb": mem_gb,
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system_info": info.decode(errors="replace").strip() if isinstance(info, bytes) else str(info),
        "numpy": np.__version__,
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


class ForeignLoad:
    """CPU time used by processes outside this run (not this process or its descendants), from /proc.

    The bench shares the machine with whatever else runs on it; a neighbour's burst slows
    whichever system happens to be answering. Each round records this load, and with a
    limit set, waits for it to drop first.
    """

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.available = Path("/proc/stat").exists()

    def _snapshot(self) -> tuple[int, int]:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        busy = user + nice + system + irq + softirq + steal
        me = os.getpid()
        procs: dict[int, tuple[int, int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            rest = stat[stat.rindex(")") + 2 :].split()
            procs[int(entry.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
        ours, frontier = {me}, [me]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        while frontier:
            for child in children.get(frontier.pop(), []):
                if child not in ours:
                    ours.add(child)
                    frontier.append(child)
        return busy, sum(procs[p][1] for p in ours if p in procs)

    def sample(self, window_s: float = 0.5) -> float | None:
        """Cores' worth of CPU others used over ``window_s``; None where /proc is missing."""
        if not self.available:
            return None
        busy0, ours0 = self._snapshot()
        time.sleep(window_s)
        busy1, ours1 = self._snapshot()
        return max(0.0, ((busy1 - busy0) - (ours1 - ours0)) / self.tick / window_s)

    def begin(self) -> tuple[float, tuple[int, int]] | None:
        """Start measuring what others use over a span of work; pass the result to `end`."""
        return (time.monotonic(), self._snapshot()) if self.available else None

    def end(self, mark: tuple[float, tuple[int, int]] | None) -> float | None:
        """Cores' worth of CPU others used since `begin`; None for spans too short for the kernel's tick to resolve."""
        if mark is None:
            return None
        t0, (busy0, ours0) = mark
        busy1, ours1 = self._snapshot()
        span = time.monotonic() - t0
        return max(0.0, ((busy1 - busy0) - (ours1 - ours0)) / self.tick / span) if span >= 0.25 else None

    def wait_below(self, cores: float, timeout_s: float = 120.0) -> tuple[float | None, float]:
        """Sample until others use less than ``cores`` (or ``timeout_s`` passed); returns (last load, seconds waited)."""
        t0 = time.monotonic()
        load = self.sample()
        while load is not None and load >= cores and time.monotonic() - t0 < timeout_s:
            load = self.sample(1.0)
        return load, time.monotonic() - t0

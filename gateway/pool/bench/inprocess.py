"""llama-cpp-python in this process as benchmark systems: ``cold``, ``llama-ram`` and ``llama-disk``.

The three share one in-process model (same weights in memory, same threads). Time to
first token is taken when the first token has been sampled, by a stopping-criteria hook.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np

from gateway.pool.bench.systems import SAMPLING, Sample, _loadavg
from gateway.pool.bench.workloads import Request
from worker.engine.context import open_llama


class InProcessModel:
    """One ``llama_cpp.Llama`` with the workers' KV layout, counting the prompt tokens each request evaluates."""

    def __init__(self, path: Path, *, n_ctx: int, threads: int) -> None:
        self.llm = open_llama(path, flash_attn=False, n_ctx=n_ctx, n_batch=512, n_threads=threads)
        self.eos = int(self.llm.token_eos())
        self._evaluated: int | None = None
        plain_eval = self.llm.eval

        def counting_eval(tokens: Sequence[int]) -> None:
            if self._evaluated is None:
                self._evaluated = len(tokens)
            plain_eval(tokens)

        self.llm.eval = counting_eval  # type: ignore[method-assign]

    def complete(self, tokens: list[int], max_tokens: int, cache: llama_cpp.BaseLlamaCache | None) -> tuple[float, float, int, int]:
        """(time to first token, total, prompt tokens evaluated, completion tokens) of one ``create_completion``."""
        llm = self.llm
        llm.set_cache(cache)
        llm.reset()
        self._evaluated = None
        first: list[float] = []

        def first_token(_ids: np.ndarray, _logits: np.ndarray) -> bool:
            if not first:
                first.append(time.perf_counter())
            return False

        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # LlamaDiskCache prints on every store
                out = llm.create_completion(
                    tokens,
                    max_tokens=max_tokens,
                    logit_bias={self.eos: -100.0},
                    stopping_criteria=llama_cpp.StoppingCriteriaList([first_token]),
                    temperature=SAMPLING["temperature"],
                    top_k=int(SAMPLING["top_k"]),
                    top_p=SAMPLING["top_p"],
                    min_p=SAMPLING["min_p"],
                    repeat_penalty=SAMPLING["repeat_penalty"],
                )
        finally:
            llm.set_cache(None)
        t_end = time.perf_counter()
        ttft = (first[0] if first else t_end) - t0
        return ttft, t_end - t0, self._evaluated or 0, int(out["usage"]["completion_tokens"])  # type: ignore[index]

    def suffix_eval(self, tokens: list[int], keep: int) -> float:
        """Seconds to evaluate ``tokens[keep:]`` on top of a context already holding ``tokens[:keep]``, and pick a token.

        Called right after a request for the same prompt, whose cells are still in the context.
        """
        llm = self.llm
        if llm.n_tokens < keep or list(llm.input_ids[:keep]) != tokens[:keep]:
            raise RuntimeError("the context does not hold the prefix to keep")
        llm._ctx.kv_cache_seq_rm(-1, keep, -1)
        llm.n_tokens = keep
        t0 = time.perf_counter()
        llm.eval(tokens[keep:])
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        int(np.argmax(logits))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.llm.close()


class LlamaCppSystem:
    """llama-cpp-python on its own: no cache (``cold``), `LlamaRAMCache` or `LlamaDiskCache`."""

    def __init__(self, name: str, model: InProcessModel, kind: str, *, model_label: str, scratch: Path, clock: float) -> None:
        if kind not in ("cold", "ram", "disk"):
            raise ValueError(kind)
        self.name = name
        self.model = model
        self.kind = kind
        self.model_label = model_label
        self.scratch = scratch
        self.clock = clock
        self.cache: llama_cpp.BaseLlamaCache | None = None
        self.cache_dir: Path | None = None

    def begin(self, workload: str) -> None:
        if self.kind == "ram":
            self.cache = llama_cpp.LlamaRAMCache(capacity_bytes=8 << 30)
        elif self.kind == "disk":
            self.cache_dir = self.scratch / f"disk-cache-{workload}"
            self.cache = llama_cpp.LlamaDiskCache(cache_dir=str(self.cache_dir), capacity_bytes=8 << 30)

    def end(self, workload: str) -> None:
        if isinstance(self.cache, llama_cpp.LlamaDiskCache):
            self.cache.cache.close()
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
        self.cache, self.cache_dir = None, None

    def run(self, req: Request, max_tokens: int) -> Sample | None:
        ttft, total, evaluated, completion = self.model.complete(req.tokens, max_tokens, self.cache)
        if req.warmup:
            return None
        return Sample(
            model=self.model_label,
            workload=req.workload,
            system=self.name,
            request=req.index,
            label=req.label,
            prompt_tokens=req.n,
            ttft_s=ttft,
            total_s=total,
            evaluated_tokens=evaluated,
            reused_tokens=req.n - evaluated,
            completion_tokens=completion,
            at_s=time.monotonic() - self.clock,
            loadavg_1m=_loadavg(),
        )

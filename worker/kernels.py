"""The kernel fingerprint: what decides the bits llama.cpp computes, read from the loaded library.

The same model, prompt and KV layout give other bits on another kind of machine:
llama.cpp's CPU kernels differ between an AVX-512 build, an AVX2-only build and one
without llamafile's sgemm (measured on SmolLM2: more than half of a sequence state's
bytes differ, logits by up to 0.78), and a GPU computes other bits again. Cells
computed by one kind of kernel and restored by another are not what a cold
evaluation there would give, so two workers share chunks only when their kernel
fingerprints match (`worker.cache.namespace` puts the fingerprint into the blob namespace).

The fingerprint is read from the library the worker loaded, never from the CPU or the
environment at large:

* ``llama_print_system_info()``: each backend llama.cpp registered (CPU, CUDA,
  Metal, ...) with the features it was built for, e.g. ``CPU : SSE3 = 1 | AVX = 1 |
  AVX2 = 1 | F16C = 1 | FMA = 1 | AVX512 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 |``.
  Features that say how work is spread over threads (``OPENMP``; thread counts, which
  some builds print first) are left out: every element is computed by one thread
  whatever their number. A feature reported as ``0`` (older builds) is absent. A build
  with ``deploy/patches/flash-attn-rows.patch`` reports ``FA_ROWS = 1``: its flash
  attention computes other bits than a stock build's, so their chunks stay apart.
* the devices other than the CPU (GPUs, accelerators such as BLAS) and how many
  layers are offloaded, when the library can offload at all;
* the switches llama.cpp's CPU backend reads once at start-up that choose other
  kernels (`SWITCHES`), as llama.cpp reads them;
* the *exactness mode* of the engine: how it batches what it evaluates
  (``decode=seq1``, `DECODE_SEQ1`: never a prompt batch that ends on one token). The
  batched engine (`worker.engine.loop`) and every decode mode (`worker.engine.decoding`: single,
  pair, settle) publish only cells that equal a cold evaluation's, each sequence in a
  KV stream of its own, so they add no mode: a worker of any ``KVPOOL_PARALLEL`` and
  any decode mode shares chunks with the others (tested in `tests/worker/test_batched.py`,
  cells after prompt and answer byte-identical to a cold evaluation's).

`KernelFingerprint.canonical` is a sorted, stable string, e.g.
``cpu=AVX,AVX2,F16C,FMA,LLAMAFILE,REPACK,SSE3,SSSE3;decode=seq1;offload=none;v=1``,
and `KernelFingerprint.digest` its short hash, which is what enters the namespace.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

import xxhash

FORMAT = 1
"""Version of the canonical string: a change of what is read or how it is written bumps it."""

DECODE_SEQ1 = "seq1"
"""One sequence per batch, prompts in batches of two or more tokens (`worker.engine.llama_state.batch_sizes`)."""

IGNORED_FEATURES = frozenset({"OPENMP", "N_THREADS", "N_THREADS_BATCH"})
"""How work is spread over threads, not what a thread computes."""

SWITCHES = ("GGML_CPU_DISABLE_FUSION", "GGML_CPU_TILED_MM", "GGML_CPU_TILED_MM_FORCE")
"""llama.cpp's own environment switches that pick other CPU kernels (read once, when its CPU backend starts)."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]+")


def _clean(text: str) -> str:
    """A name or value with nothing that could be taken for a separator of the canonical string."""
    return _UNSAFE.sub("+", text.strip()).strip("+")


@dataclass(frozen=True)
class Backend:
    """One ggml backend and the features it reports, sorted by name (value ``1`` for a plain flag)."""

    name: str
    features: tuple[tuple[str, str], ...] = ()

    def canonical(self) -> str:
        listed = ",".join(n if v == "1" else f"{n}:{v}" for n, v in self.features)
        return f"{self.name.lower()}={listed}"


@dataclass(frozen=True)
class KernelFingerprint:
    """What decides the bits of every cell a worker computes (see the module docstring)."""

    backends: tuple[Backend, ...]
    offload: str = "none"
    """``none`` when the library cannot offload; else ``ngl:<layers>`` (``ngl:all`` for -1) and the devices."""
    switches: tuple[tuple[str, str], ...] = ()
    decode: str = DECODE_SEQ1

    def canonical(self) -> str:
        parts = [b.canonical() for b in self.backends]
        parts += [f"decode={self.decode}", f"offload={self.offload}", f"v={FORMAT}"]
        parts += [f"{k}={v}" for k, v in self.switches]
        return ";".join(sorted(parts))

    @property
    def digest(self) -> str:
        """16 hex digits of xxh3-64 over `canonical`: what the blob namespace and the metric labels carry."""
        return xxhash.xxh3_64_hexdigest(self.canonical().encode())


def parse_system_info(text: str) -> tuple[Backend, ...]:
    """The backends and features of a ``llama_print_system_info()`` string, in a stable order.

    Reads today's form (``CPU : AVX = 1 | ... | CUDA : ARCHS = 890 | ...``), the older
    one without backend names (``AVX = 1 | AVX512 = 0 | ...``, taken as the CPU's) and
    a ``system_info: n_threads = 8 / 16 |`` prefix as printed by llama.cpp's tools.
    A fragment that is not ``NAME = value`` is kept whole as a flag, so that nothing the
    library says is silently dropped.
    """
    text = re.sub(r"^\s*system_info\s*:", "", text.strip())
    found: dict[str, dict[str, str]] = {}
    current = "CPU"
    for fragment in text.split("|"):
        *names, feature = [p.strip() for p in fragment.split(" : ")]
        for name in names:
            current = _clean(name) or current
            found.setdefault(current, {})
        name, sep, value = feature.partition("=")
        name, value = _clean(name).upper(), _clean(value) if sep else "1"
        if not name:
            continue
        if name.split("+")[0] in IGNORED_FEATURES or value in ("", "0"):
            continue
        found.setdefault(current, {})[name] = value
    return tuple(Backend(n, tuple(sorted(f.items()))) for n, f in sorted(found.items()))


def _atoi(value: str) -> int:
    """C's ``atoi``, which is how llama.cpp reads its switches."""
    m = re.match(r"\s*[+-]?\d+", value)
    return int(m.group()) if m else 0


def read_switches(environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The kernel switches (`SWITCHES`) as llama.cpp reads them: only those set away from their default appear."""
    out = []
    if _atoi(environ.get("GGML_CPU_DISABLE_FUSION", "0")) == 1:
        out.append(("fusion", "off"))
    if "GGML_CPU_TILED_MM" in environ and _atoi(environ["GGML_CPU_TILED_MM"]) == 0:
        out.append(("tiled_mm", "off"))
    if _atoi(environ.get("GGML_CPU_TILED_MM_FORCE", "0")) == 1:
        out.append(("tiled_mm_force", "on"))
    return tuple(out)


def fingerprint_of(
    system_info: str,
    *,
    devices: tuple[str, ...] = (),
    gpu_offload: bool = False,
    n_gpu_layers: int = 0,
    environ: Mapping[str, str] | None = None,
    decode: str = DECODE_SEQ1,
) -> KernelFingerprint:
    """The fingerprint of a library that reports ``system_info`` and ``devices`` (names of its non-CPU devices)."""
    offload = "none"
    if gpu_offload:
        layers = "all" if n_gpu_layers < 0 else str(n_gpu_layers)
        offload = "+".join([f"ngl:{layers}", *sorted(_clean(d) for d in devices)])
    switches = read_switches(os.environ if environ is None else environ)
    return KernelFingerprint(parse_system_info(system_info), offload, switches, decode)


def library_fingerprint(n_gpu_layers: int = 0, decode: str = DECODE_SEQ1) -> KernelFingerprint:
    """The fingerprint of the llama.cpp this process loaded."""
    import llama_cpp

    info, devices = _library_report()
    return fingerprint_of(
        info,
        devices=devices,
        gpu_offload=bool(llama_cpp.llama_supports_gpu_offload()),
        n_gpu_layers=n_gpu_layers,
        decode=decode,
    )


@cache
def _library_report() -> tuple[str, tuple[str, ...]]:
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode("utf-8", "replace"), _devices()


_CPU_DEVICE = 0  # ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_CPU


def _devices() -> tuple[str, ...]:
    """``name:description`` of every non-CPU ggml device (GPUs, BLAS, ...), read through ggml's C API."""
    try:
        from llama_cpp._ggml import libggml

        count, get = libggml.ggml_backend_dev_count, libggml.ggml_backend_dev_get
        kind, name, about = libggml.ggml_backend_dev_type, libggml.ggml_backend_dev_name, libggml.ggml_backend_dev_description
    except (ImportError, OSError, AttributeError):
        return ()
    count.restype, get.restype, get.argtypes = ctypes.c_size_t, ctypes.c_void_p, [ctypes.c_size_t]
    kind.restype, kind.argtypes = ctypes.c_int, [ctypes.c_void_p]
    for fn in (name, about):
        fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    out = []
    for i in range(count()):
        dev = get(i)
        if dev and kind(dev) != _CPU_DEVICE:
            out.append(f"{(name(dev) or b'').decode(errors='replace')}:{(about(dev) or b'').decode(errors='replace')}")
    return tuple(out)

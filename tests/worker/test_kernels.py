"""The kernel fingerprint: parsed from what llama.cpp says of itself, changed by what changes the bits and nothing else.

The ``system_info`` strings below are what ``llama_print_system_info()`` prints on the
kinds of machine a fleet mixes (the first is this project's default build on an AVX-512
host; the second what ``-DGGML_NATIVE=OFF -DGGML_AVX512=OFF`` builds, as an AVX2-only
host runs; then one built without llamafile's sgemm, one with CUDA, an ARM host, and the
older form without backend names).
"""

from __future__ import annotations

import llama_cpp
import pytest

from worker.cache.namespace import SHARED_KERNELS, namespace_for
from worker.kernels import Backend, KernelFingerprint, fingerprint_of, library_fingerprint, parse_system_info, read_switches
from worker.settings import WorkerSettings

AVX512 = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | "
    "AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
AVX2 = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
NO_LLAMAFILE = AVX512.replace("LLAMAFILE = 1 | ", "")
CUDA = "CUDA : ARCHS = 500,610,700,750,800,860,890 | FORCE_MMQ = 1 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | " + AVX512
ARM_SVE = "CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | MATMUL_INT8 = 1 | SVE = 1 | DOTPROD = 1 | SVE_CNT = 16 | OPENMP = 1 | REPACK = 1 | "
LEGACY = (
    "AVX = 1 | AVX_VNNI = 0 | AVX2 = 1 | AVX512 = 0 | AVX512_VBMI = 0 | AVX512_VNNI = 0 | AVX512_BF16 = 0 | FMA = 1 | "
    "NEON = 0 | SVE = 0 | ARM_FMA = 0 | F16C = 1 | FP16_VA = 0 | WASM_SIMD = 0 | BLAS = 0 | SSE3 = 1 | SSSE3 = 1 | "
    "VSX = 0 | MATMUL_INT8 = 0 | LLAMAFILE = 1 | "
)
RECORDED = {"avx512": AVX512, "avx2": AVX2, "no_llamafile": NO_LLAMAFILE, "cuda": CUDA, "arm_sve": ARM_SVE, "legacy": LEGACY}


def canonical(info: str, **kw: object) -> str:
    return fingerprint_of(info, environ={}, **kw).canonical()  # type: ignore[arg-type]


def test_an_avx512_build_is_read_feature_by_feature() -> None:
    (cpu,) = parse_system_info(AVX512)
    assert cpu.name == "CPU"
    assert dict(cpu.features) == {
        f: "1" for f in "SSE3 SSSE3 AVX AVX2 F16C FMA BMI2 AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16 LLAMAFILE REPACK".split()
    }
    assert canonical(AVX512) == (
        "cpu=AVX,AVX2,AVX512,AVX512_BF16,AVX512_VBMI,AVX512_VNNI,BMI2,F16C,FMA,LLAMAFILE,REPACK,SSE3,SSSE3;decode=seq1;offload=none;v=1"
    )


def test_a_gpu_build_names_each_backend_and_its_values() -> None:
    cpu, cuda = parse_system_info(CUDA)  # sorted by name, whatever order llama.cpp registered them in
    assert (cpu.name, cuda.name) == ("CPU", "CUDA")
    assert dict(cuda.features)["ARCHS"] == "500+610+700+750+800+860+890"  # commas would read as separators
    assert canonical(CUDA).startswith("cpu=AVX,") and ";cuda=ARCHS:500+610+700+750+800+860+890,FORCE_MMQ," in canonical(CUDA)


def test_every_kind_of_machine_gets_its_own_fingerprint() -> None:
    prints = {name: canonical(info) for name, info in RECORDED.items()}
    assert len(set(prints.values())) == len(prints), prints
    assert len({fingerprint_of(info, environ={}).digest for info in RECORDED.values()}) == len(RECORDED)


@pytest.mark.parametrize("feature", ["AVX512", "AVX512_VNNI", "LLAMAFILE", "REPACK", "FMA", "F16C", "AMX_INT8", "KLEIDIAI"])
def test_one_feature_more_or_less_changes_it(feature: str) -> None:
    with_it = AVX512 if f"{feature} = 1" in AVX512 else AVX512 + f"{feature} = 1 | "
    without = with_it.replace(f"{feature} = 1 | ", "")
    assert canonical(with_it) != canonical(without)


def test_a_vector_length_read_at_run_time_changes_it() -> None:
    assert canonical(ARM_SVE) != canonical(ARM_SVE.replace("SVE_CNT = 16", "SVE_CNT = 32"))


@pytest.mark.parametrize(
    "variant",
    [
        AVX512.replace("OPENMP = 1 | ", ""),  # threading, not arithmetic
        "system_info: n_threads = 8 (n_threads_batch = 8) / 16 | " + AVX512,  # as llama.cpp's tools print it
        "system_info: n_threads = 2 / 2 | " + AVX512,
        "CPU : " + " | ".join(reversed(AVX512.removeprefix("CPU : ").split(" | ")[:-1])) + " | ",  # another order
        AVX512.replace(" = ", "=").replace(" | ", "|"),
        AVX512 + "AVX_VNNI = 0 | ",  # reported, but absent
    ],
)
def test_what_does_not_decide_the_bits_leaves_it_alone(variant: str) -> None:
    assert canonical(variant) == canonical(AVX512)


def test_the_older_form_without_backend_names_is_the_cpu() -> None:
    (cpu,) = parse_system_info(LEGACY)
    assert cpu.name == "CPU" and dict(cpu.features) == {f: "1" for f in "AVX AVX2 FMA F16C SSE3 SSSE3 LLAMAFILE".split()}


def test_a_fragment_it_cannot_read_is_kept_not_dropped() -> None:
    assert canonical(AVX512 + "SOMETHING NEW | ") != canonical(AVX512)


def test_offloaded_layers_and_the_device_count_where_the_library_can_offload() -> None:
    cpu_only = canonical(CUDA, gpu_offload=False, n_gpu_layers=99)
    h200 = canonical(CUDA, gpu_offload=True, n_gpu_layers=99, devices=("CUDA0:NVIDIA H200",))
    assert "offload=none" in cpu_only and "offload=ngl:99+CUDA0+NVIDIA+H200" in h200
    assert canonical(CUDA, gpu_offload=True, n_gpu_layers=-1, devices=("CUDA0:NVIDIA H200",)) != h200
    assert canonical(CUDA, gpu_offload=True, n_gpu_layers=99, devices=("CUDA0:NVIDIA L4",)) != h200
    assert canonical(AVX512, gpu_offload=False, n_gpu_layers=0) == canonical(AVX512, gpu_offload=False, n_gpu_layers=99)


def test_llama_cpps_own_kernel_switches_count_as_llama_cpp_reads_them() -> None:
    assert read_switches({}) == read_switches({"GGML_CPU_DISABLE_FUSION": "0", "GGML_CPU_TILED_MM": "1", "OMP_NUM_THREADS": "3"}) == ()
    assert read_switches({"GGML_CPU_DISABLE_FUSION": "1"}) == (("fusion", "off"),)
    assert read_switches({"GGML_CPU_TILED_MM": "0"}) == read_switches({"GGML_CPU_TILED_MM": "no"}) == (("tiled_mm", "off"),)
    assert read_switches({"GGML_CPU_TILED_MM_FORCE": "1"}) == (("tiled_mm_force", "on"),)
    assert fingerprint_of(AVX512, environ={"GGML_CPU_TILED_MM": "0"}).canonical().endswith(";tiled_mm=off;v=1")


def test_the_exactness_mode_of_the_engine_is_a_field() -> None:
    base = KernelFingerprint((Backend("CPU", (("AVX2", "1"),)),))
    assert base.decode == "seq1" and "decode=seq1" in base.canonical()
    assert KernelFingerprint(base.backends, decode="batch").canonical() != base.canonical()


def test_the_loaded_library_is_read_as_it_reports_itself() -> None:
    fp = library_fingerprint()
    assert fp.backends == parse_system_info(llama_cpp.llama_print_system_info().decode())
    assert "CPU" in {b.name for b in fp.backends} and fp.decode == "seq1"
    if not llama_cpp.llama_supports_gpu_offload():
        assert fp.offload == "none" and library_fingerprint(n_gpu_layers=99) == fp  # nothing to offload to


def test_the_namespace_carries_the_digest_or_says_it_is_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    exact = namespace_for(WorkerSettings(chunk_size=64), "fp")
    shared = namespace_for(WorkerSettings(chunk_size=64, share_across_kernels=True), "fp")
    assert dict(exact.layout.extras)["kernels"] == library_fingerprint().digest
    assert dict(shared.layout.extras)["kernels"] == SHARED_KERNELS and shared.key != exact.key
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    assert namespace_for(WorkerSettings(chunk_size=64), "fp").key != exact.key
    assert namespace_for(WorkerSettings(chunk_size=64, share_across_kernels=True), "fp").key == shared.key

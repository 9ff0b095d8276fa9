"""A worker uses the threads it is given, for prompts as for generation: N workers never run N x cores threads."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.pool.procs import WorkerProcess
from gateway.pool.up import default_workers
from worker.answering import Engine
from worker.cpus import SPINCOUNT, WAIT_VARIABLES, available_cpus, cgroup_cpu_quota, quiet_openmp
from worker.settings import WorkerSettings


@pytest.mark.parametrize(("env", "threads", "batch"), [({"n_threads": 1}, 1, 1), ({"n_threads": 1, "n_threads_batch": 2}, 1, 2)])
def test_prompt_threads_follow_the_settings(tiny_model: Path, env: dict[str, int], threads: int, batch: int) -> None:
    engine = Engine.open(WorkerSettings(publish=False, self_check=False, **env), tiny_model, store=None, name="t")
    try:
        params = engine.llm.context_params
        assert (params.n_threads, params.n_threads_batch) == (threads, batch)
    finally:
        engine.close()


def test_unset_threads_are_llama_cpps_defaults_within_the_cpus_allowed() -> None:
    s, cpus = WorkerSettings(), available_cpus()
    assert (s.n_threads, s.threads_batch()) == (min(max((os.cpu_count() or 1) // 2, 1), cpus), min(os.cpu_count() or 1, cpus))


def test_n_threads_batch_defaults_to_n_threads() -> None:
    assert WorkerSettings(n_threads=3).threads_batch() == 3
    assert WorkerSettings(n_threads=3, n_threads_batch=1).threads_batch() == 1


@pytest.mark.parametrize(("cores", "split"), [(1, (1, 1)), (2, (1, 2)), (4, (2, 2)), (16, (4, 4)), (64, (16, 4))])
def test_up_splits_the_cores_without_oversubscribing(cores: int, split: tuple[int, int]) -> None:
    workers, threads = default_workers(cores)
    assert (workers, threads) == split and workers * threads == cores


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter of this environment (its affinity and OpenMP runtime its own)."""
    root = Path(__file__).resolve().parents[2]
    base = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES and not k.startswith("KVPOOL_")}
    return subprocess.run(
        [sys.executable, "-c", code], env={**base, "PYTHONPATH": str(root), **(env or {})}, capture_output=True, text=True, check=True
    )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to take one away")
def test_threads_count_only_the_cpus_the_process_may_use() -> None:
    """Under an affinity mask (taskset, a cpuset) of one CPU: one thread, and ``kvpool up`` plans for one core, not the machine's."""
    out = _python(
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from worker.settings import WorkerSettings; from gateway.pool.up import default_workers; from worker.cpus import available_cpus\n"
        "s = WorkerSettings(); print(available_cpus(), s.n_threads, s.threads_batch(), *default_workers())"
    )
    assert out.stdout.split() == ["1", "1", "1", "1", "1"]


def _cgroup(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "sys-fs-cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_line)
    return root, proc


@pytest.mark.parametrize(
    ("proc_line", "files", "quota"),
    [
        ("0::/kubepods/pod1/ctr\n", {"kubepods/pod1/ctr/cpu.max": "150000 100000\n", "kubepods/pod1/cpu.max": "max 100000\n"}, 1.5),
        ("0::/kubepods/pod1/ctr\n", {"kubepods/pod1/ctr/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "50000 100000\n"}, 0.5),
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),
        ("0::/host/view/of/ctr\n", {"cpu.max": "200000 100000\n"}, 2.0),  # in a container: its own cgroup is the mount's root
        (
            "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n",
            {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"},
            3.0,
        ),
        ("4:cpu,cpuacct:/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),
    ],
)
def test_the_cgroup_cpu_quota_is_read_from_v2_and_v1(tmp_path: Path, proc_line: str, files: dict[str, str], quota: float | None) -> None:
    root, proc = _cgroup(tmp_path, proc_line, files)
    assert cgroup_cpu_quota(root, proc) == quota
    cpus = len(os.sched_getaffinity(0))
    assert available_cpus(root, proc) == (cpus if quota is None else max(1, min(cpus, int(quota))))


def test_a_quota_of_part_of_a_cpu_still_gets_one_thread(tmp_path: Path) -> None:
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "20000 100000\n"})
    assert available_cpus(root, proc) == 1


def _openmp_settings(code: str, env: dict[str, str] | None = None) -> str:
    """What the OpenMP runtime that llama_cpp loads says of its settings (``omp_display_env``), after ``code`` ran."""
    out = _python(
        f"{code}\nimport ctypes, llama_cpp\nctypes.CDLL('libgomp.so.1').omp_display_env(1)",
        env,
    )
    return out.stderr + out.stdout


def test_openmp_threads_spin_briefly_then_sleep_in_a_worker() -> None:
    """libgomp's threads poll 300,000 times at each barrier by default: a worker bounds that, before llama_cpp loads."""
    assert "GOMP_SPINCOUNT = '300000'" in _openmp_settings("")
    assert f"GOMP_SPINCOUNT = '{SPINCOUNT}'" in _openmp_settings("from worker.cpus import quiet_openmp; quiet_openmp()")


def test_an_operators_openmp_wait_policy_is_kept() -> None:
    shown = _openmp_settings("from worker.cpus import quiet_openmp; quiet_openmp()", {"OMP_WAIT_POLICY": "active"})
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in shown
    env: dict[str, str] = {"GOMP_SPINCOUNT": "5"}
    assert quiet_openmp(env) == "GOMP_SPINCOUNT=5" and env == {"GOMP_SPINCOUNT": "5"}


def test_the_wait_policy_cannot_be_set_once_llama_cpp_is_loaded() -> None:
    import llama_cpp  # noqa: F401  (the OpenMP runtime has read its settings)

    with pytest.raises(RuntimeError, match="before llama_cpp"):
        quiet_openmp({})


def test_a_worker_process_logs_its_threads_and_wait_policy(start_worker: Callable[..., WorkerProcess]) -> None:
    line = next(x for x in start_worker("w-threads", KVPOOL_N_THREADS="1").log().splitlines() if " worker.threads " in x)
    assert "n_threads=1 n_threads_batch=1 " in line and f'openmp="GOMP_SPINCOUNT={SPINCOUNT}"' in line

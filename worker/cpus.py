"""The CPUs this process may really use, and how llama.cpp's threads wait for each other on them.

llama.cpp splits every operation of a graph between its threads, which meet at a barrier
after each one (hundreds per token). The llama-cpp-python wheel is built with OpenMP,
whose threads *spin* at a barrier (GNU libgomp: 300,000 polls) before they sleep. That is
fastest while every thread has a core of its own, and a collapse as soon as one has not:
a thread whose partner was preempted spins out its time slice on the core the partner
waits for. With a busy loop on one of 2 cores, a worker's 2 threads each burned 37 s of
CPU on a request that needs 7 s alone (10,500 preemptions each, no sleep), and the request
took 78 s; with the spin bounded they slept at barriers instead and it took 13 s
(docs/bench/neighbour.md). Two things give a process fewer cores than it counts:

* a CPU limit it can see: an affinity mask (taskset, cpusets) or a cgroup CPU quota (a
  Kubernetes ``limits.cpu``): `available_cpus` counts them, and the worker's default
  thread count never exceeds it;
* a neighbour it cannot see (another process on the same cores): only threads that soon
  sleep when they wait keep their speed. `quiet_openmp` bounds the spin to libgomp's own
  value for oversubscribed cores (``GOMP_SPINCOUNT=1000``) unless the operator chose a
  policy. It must run before llama_cpp is imported: libgomp reads its environment once,
  when it is loaded. ``OMP_WAIT_POLICY=passive`` (no spin at all) recovers as much under a
  neighbour but cost 40% of the decode speed without one.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""An operator who sets either has chosen how OpenMP's threads wait; `quiet_openmp` leaves both alone then."""
SPINCOUNT = "1000"
"""Polls before a waiting thread sleeps: libgomp's own choice when it knows there are more threads than cores."""


def available_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """CPUs this process may run on: its affinity mask, lowered to a cgroup CPU quota (rounded down, at least 1).

    Rounded down, as Go's automaxprocs does: threads that compute without pause under a
    quota of 1.5 CPUs use it up and are stopped for the rest of each period.
    """
    cpus = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(root, proc_cgroup)
    return cpus if quota is None else max(1, min(cpus, math.floor(quota)))


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup and its ancestors, v2 or v1; None without one."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy, cpu.max = "$MAX $PERIOD" or "max $PERIOD"
            found += _quotas(root, path, "cpu.max", _v2_quota)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            found += _quotas(root / controllers, path, "cpu.cfs_quota_us", _v1_quota)
    return min(found, default=None)


def _quotas(mount: Path, path: str, name: str, parse: Callable[[Path, str], float | None]) -> list[float]:
    """Quotas of the cgroup at ``path`` under ``mount`` and of its ancestors, up to the mount's root.

    In a container the mount's root is the container's own cgroup while ``path`` may still
    name it as the host sees it: its files are then read at the root.
    """
    folder = mount / path.strip("/")
    if not folder.is_dir():
        folder = mount
    out: list[float] = []
    while True:
        try:
            quota = parse(folder, name)
        except (OSError, ValueError):
            quota = None
        if quota is not None:
            out.append(quota)
        if folder == mount or mount not in folder.parents:
            return out
        folder = folder.parent


def _v2_quota(folder: Path, name: str) -> float | None:
    limit, period = (folder / name).read_text().split()
    return None if limit == "max" else int(limit) / int(period)


def _v1_quota(folder: Path, name: str) -> float | None:
    quota = int((folder / name).read_text())
    return None if quota < 0 else quota / int((folder / "cpu.cfs_period_us").read_text())


def quiet_openmp(environ: MutableMapping[str, str] = os.environ) -> str:
    """Bound how long OpenMP's threads spin before they sleep (unless the operator chose); the wait settings in force.

    Raises `RuntimeError` when llama_cpp is already loaded: its OpenMP runtime has read its
    settings then, and a later change would silently do nothing.
    """
    if not any(k in environ for k in WAIT_VARIABLES):
        if "llama_cpp" in sys.modules:
            raise RuntimeError("quiet_openmp must run before llama_cpp is imported")
        environ["GOMP_SPINCOUNT"] = SPINCOUNT
    return openmp_wait(environ)


def openmp_wait(environ: Mapping[str, str] = os.environ) -> str:
    """The OpenMP wait settings of this process's environment, for its logs ("default": none)."""
    return ", ".join(f"{k}={environ[k]}" for k in WAIT_VARIABLES if k in environ) or "default"

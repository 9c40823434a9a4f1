"""How many CPUs this process may use: its affinity mask, and the CPU quota of its cgroup (v2 or v1).

torch sizes its intra-op pool from the machine's cores. In a container with a CPU limit on a larger
node, or on cores another busy process shares, that pool is larger than the CPU time it gets, and
its threads spend the step waiting for each other at OpenMP barriers (docs/operations.md, "CPU
threads", measured by `bench/server_vs_offline.py threads`). `EngineConfig.threads` defaults to this
count instead (`default_threads`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

_PROC_CGROUP = Path("/proc/self/cgroup")
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_cpus(proc_cgroup: Path = _PROC_CGROUP, cgroup_root: Path = _CGROUP_ROOT) -> int:
    """CPUs in this process's affinity mask, at most its cgroup's CPU quota rounded down (at least 1:
    a pool larger than the quota is throttled, one smaller leaves part of it unused)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def default_threads(environ: Optional[Mapping[str, str]] = None) -> int:
    """`EngineConfig.threads` when unset: the CPUs this process may use, and no more than
    OMP_NUM_THREADS where that is set (OpenMP's own variable, which torch's pool also obeys)."""
    environ = os.environ if environ is None else environ
    cpus = available_cpus()
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    return min(cpus, int(omp)) if omp.isdigit() and int(omp) > 0 else cpus


def set_threads(threads: Optional[int] = None) -> int:
    """Size torch's intra-op pool: `threads`, or `default_threads()` when None. Process-wide: call it
    before any work (the engine and every command do). Returns the count set."""
    import torch

    count = threads or default_threads()
    torch.set_num_threads(count)
    return count


def cgroup_cpu_quota(proc_cgroup: Path = _PROC_CGROUP, cgroup_root: Path = _CGROUP_ROOT) -> Optional[float]:
    """The smallest CPU quota (in CPUs) on the way from this process's cgroup up to the root, or None
    when there is none (no limit, no cgroup file system, not Linux)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy, `cpu.max` = "<quota|max> <period>"
            quotas += [_v2_quota(d / "cpu.max") for d in _ancestors(cgroup_root, path)]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            for mount in (cgroup_root / controllers, cgroup_root / "cpu"):
                quotas += [_v1_quota(d) for d in _ancestors(mount, path)]
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _ancestors(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory and its parents up to the mount; inside a container the mount may be
    the container's own cgroup while `path` is the host's, so the mount itself is always included."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [mount.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]


def _v2_quota(file: Path) -> Optional[float]:
    try:
        quota, period = file.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> Optional[float]:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period

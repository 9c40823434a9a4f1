"""The CPUs a process may use (engine.cpus) on hand-built cgroup trees, and the engine's thread setting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig
from engine.cpus import available_cpus, cgroup_cpu_quota, default_threads


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_takes_the_smallest_quota_up_the_tree(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/kubepods/pod1/container\n")
    root = tmp_path / "fs"
    _write(root / "kubepods" / "cpu.max", "max 100000\n")
    _write(root / "kubepods" / "pod1" / "cpu.max", "250000 100000\n")
    _write(root / "kubepods" / "pod1" / "container" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(proc, root) == 2.5
    affinity = len(os.sched_getaffinity(0))
    assert available_cpus(proc, root) == min(affinity, 2)  # rounded down: 2.5 CPUs of time is 2 busy threads


def test_cgroup_v1_inside_a_container_reads_its_own_mount(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "5:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")  # the host's path, not mounted here
    root = tmp_path / "fs"
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "50000\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(proc, root) == 0.5
    assert available_cpus(proc, root) == 1  # never fewer than one


def test_no_limit_and_no_cgroup_mean_the_affinity_mask(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/\n1:cpu:/\n")
    root = tmp_path / "fs"
    _write(root / "cpu" / "cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(proc, root) is None
    assert cgroup_cpu_quota(tmp_path / "missing", root) is None
    assert available_cpus(proc, root) == len(os.sched_getaffinity(0))


def test_the_engine_sets_torchs_pool(fixtures):
    before = torch.get_num_threads()
    try:
        Engine(EngineConfig(model=str(fixtures / "llada_tiny"), threads=1))
        assert torch.get_num_threads() == 1
        Engine(EngineConfig(model=str(fixtures / "llada_tiny")))
        assert torch.get_num_threads() == default_threads()
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads"):
        EngineConfig(model="m", threads=0)


def test_omp_num_threads_lowers_the_default_never_raises_it():
    cpus = available_cpus()
    assert default_threads({}) == cpus
    assert default_threads({"OMP_NUM_THREADS": "1"}) == 1
    assert default_threads({"OMP_NUM_THREADS": str(cpus + 8)}) == cpus
    assert default_threads({"OMP_NUM_THREADS": "not a number"}) == cpus

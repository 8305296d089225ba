"""How many CPUs this process may keep busy, and torch's threads sized to them.

Torch sizes its thread pool by the host's cores, whatever the process may use: in a container with a CPU
quota of 2 on a 64-core host (`docker run --cpus 2`, a Kubernetes CPU limit), 64 threads would share 2 CPUs'
time and mostly wait on each other at every parallel region's barrier. `gpt2-serve` and `gpt2-harvest` call
`size_threads` before they load the model, unless `OMP_NUM_THREADS` (or the tool's own flag) chose already.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CGROUP = Path("/sys/fs/cgroup")  # in a container, its own cgroup (Docker's and Kubernetes' cgroup namespace)


def available_cpus(cgroup: Path = CGROUP) -> int:
    """The CPUs this process can keep busy: those it may run on (its affinity, which `docker run --cpuset-cpus`
    and Kubernetes' static CPU manager narrow), or fewer where its cgroup's CPU quota (`docker run --cpus`, a
    Kubernetes CPU limit) allows less time than that, rounded up. The cgroup read is the process's own where
    the container has a cgroup namespace (Docker's and Kubernetes' default); a quota set on a parent outside
    it is not seen."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity to read
        cpus = os.cpu_count() or 1
    quota = cpu_quota(cgroup)
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def cpu_quota(cgroup: Path = CGROUP) -> float | None:
    """The CPUs' worth of time the cgroup at `cgroup` may use (quota over period), or None where it has no
    quota or none can be read: cgroup v2's `cpu.max` ("200000 100000"; "max 100000" for none), else v1's
    `cpu.cfs_quota_us` (-1 for none) over `cpu.cfs_period_us`, under `cpu/` or `cpu,cpuacct/`."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()
    except (OSError, ValueError):
        for v1 in (cgroup / "cpu", cgroup / "cpu,cpuacct"):
            try:
                quota = (v1 / "cpu.cfs_quota_us").read_text().strip()
                period = (v1 / "cpu.cfs_period_us").read_text().strip()
                break
            except OSError:
                continue
        else:
            return None
    try:
        ratio = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):  # "max", or a file we do not understand: no quota we can use
        return None
    return ratio if ratio > 0 else None  # v1's -1: no quota


def threads_for(default: int, environ: Mapping[str, str], cgroup: Path = CGROUP) -> int | None:
    """Torch's threads for this process: None where `OMP_NUM_THREADS` names them (torch has read it already),
    else torch's `default` (the host's cores, whatever the container allows) cut to `available_cpus`. Never
    more than the default: on a host with SMT torch counts physical cores, and threads on sibling hyperthreads
    only contend."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    return min(default, available_cpus(cgroup))


def size_threads(environ: Mapping[str, str]) -> None:
    """Set torch's threads (`threads_for`) before the model loads, saying so where that changes them."""
    default = torch.get_num_threads()
    threads = threads_for(default, environ)
    if threads is None or threads == default:  # torch's own choice stands: said only at --log-level debug
        log.debug("torch threads: %d (%s)", default, "OMP_NUM_THREADS" if threads is None else "torch's default")
        return
    torch.set_num_threads(threads)
    log.info(
        "torch threads: %d (the CPUs this process may use, by its affinity and its cgroup's CPU quota; torch's "
        "default was %d; set OMP_NUM_THREADS to choose)",
        threads,
        default,
    )

"""How many CPU threads to compute with, and how they wait, so that a busy neighbour cannot collapse decoding.

Batch-1 decode is a chain of small parallel regions (one per projection), each ending at a barrier. Two things
turn a neighbour into a 4-10x slowdown:

* **more threads than the CPUs the process may use**: torch (through OpenMP) starts one thread per CPU of the
  machine or of the affinity mask, but a container's CPU quota (cgroup ``cpu.max``) is not a mask, so 2 CPUs of
  quota on a 64-CPU host gave 64 threads taking turns at every barrier;
* **threads that spin at barriers**: OpenMP's default spins ~300,000 rounds before sleeping, so an idle worker
  holds a CPU the thread everyone is waiting for could have run on, and the step waits for the scheduler.

:func:`available_cpus` counts the CPUs actually granted (affinity mask and cgroup quota, v2 or v1);
:func:`configure` lowers torch's thread count to it (or sets what the user asked for). :func:`set_wait_defaults`
makes idle threads sleep; it must run before the OpenMP runtime loads, i.e. before ``import torch``, which is why
``leapdecode/__init__.py`` calls it first. Variables the user set win over ours.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
# Idle threads sleep at once instead of spinning. Measured with leapdecode.eval.contention on the shared 2-vCPU dev
# machine (bundled model, 48 tokens, tok/s, two rounds; other people's jobs were running too): beside one busy
# process, sleeping kept 142 and 147 tok/s where libgomp's default spin (300,000 rounds) gave 99 and 6 and a short spin
# (10,000 rounds) 10 and 36; with only the background load sleeping kept 121-148 where the spinning settings fell
# to 10-25 whenever that load was heavy. The price is a futex wake-up per parallel region (a decode step has ~250
# regions of ~15 us): in a quiet moment the short spin reached 274 tok/s. Even 10,000 rounds outlast the gap
# between two regions, so a spinning worker never gives its CPU back: no spin count keeps both. Robustness wins;
# a machine of one's own can ask for spinning (OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT), which we leave alone.
OPENMP_WAIT_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
THREADS_HELP = "CPU threads (default: the CPUs this process may use, from its affinity mask and cgroup CPU quota)"


def cgroup_cpu_limit(v2: Path = CGROUP_V2_MAX, v1_quota: Path = CGROUP_V1_QUOTA, v1_period: Path = CGROUP_V1_PERIOD
                     ) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (``2.5`` = 250 ms per 100 ms), or None when unlimited or
    unknown. Reads cgroup v2's ``cpu.max`` ("max 100000" or "250000 100000"), else v1's cfs quota/period."""
    try:
        quota, period = v2.read_text().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q, p = int(v1_quota.read_text()), int(v1_period.read_text())
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def available_cpus() -> int:
    """The CPUs this process can actually run on: its affinity mask, capped by its cgroup quota (rounded up: a
    quota of 1.5 CPUs still runs two threads at once, part of the time); at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, math.ceil(limit))
    return max(1, n)


def set_wait_defaults() -> None:
    """Sleeping OpenMP waits (see ``OPENMP_WAIT_DEFAULTS``). Effective only before the runtime loads (before
    ``import torch``); nothing is set when the user chose how threads wait (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    os.environ.update(OPENMP_WAIT_DEFAULTS)


def configure(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads: ``num_threads`` when given, else at most :func:`available_cpus` (a lower
    count already set, e.g. by the user or ``OMP_NUM_THREADS``, is kept). Returns the count in effect."""
    import torch

    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be an integer >= 1, got {num_threads!r}")
        want = num_threads
    else:
        want = min(torch.get_num_threads(), available_cpus())
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
    return want

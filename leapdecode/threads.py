"""How many CPU threads to compute with, and how many to use from one step to the next, so that a busy neighbour
cannot collapse decoding.

Batch-1 decode is a chain of small parallel regions (one per projection), each ending at a barrier. Two things
turn a neighbour into a 4-10x slowdown:

* **more threads than the CPUs the process may use**: torch (through OpenMP) starts one thread per CPU of the
  machine or of the affinity mask, but a container's CPU quota (cgroup ``cpu.max``) is not a mask, so 2 CPUs of
  quota on a 64-CPU host gave 64 threads taking turns at every barrier;
* **a thread whose CPU is shared with a busy process**: every region waits at its barrier for the thread the
  scheduler has just swapped out, for a time slice of milliseconds.

:func:`available_cpus` counts the CPUs actually granted (affinity mask and cgroup quota, v2 or v1);
:func:`configure` lowers torch's thread count to it (or sets what the user asked for). :class:`ThreadTuner`
then picks, between engine steps, whether all those threads or half of them decode faster right now, by timing
a step with the other count every so often next to a step of the same size.

Measured with ``python -m leapdecode.eval.contention`` on the 2-vCPU AMD EPYC (Zen 5) of 2026-12-01, a 1.1B
Q4_K_M model, batch 1, tok/s: OpenMP's default waits (spinning, then sleeping) give 39.4 quiet but 11.2 beside
one busy process with 2 threads, while 1 thread keeps 21.4 there (it gets the core the neighbour leaves).
Sleeping waits (``OMP_WAIT_POLICY=PASSIVE``) kept 20.6 beside the neighbour but cost 13% on the quiet machine
(32.5, a futex wake-up per parallel region), so we leave OpenMP's waits as they are and change the count.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
# torch's count when leapdecode was imported (OMP_NUM_THREADS or the user's own torch.set_num_threads): engines
# change torch's count as they run (ThreadTuner), so a later engine must not take that for the user's choice
INITIAL_THREADS = torch.get_num_threads()
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


def configure(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads: ``num_threads`` when given, else at most :func:`available_cpus` (a lower
    count the user chose before importing leapdecode, ``OMP_NUM_THREADS`` or ``torch.set_num_threads``, is kept:
    ``INITIAL_THREADS``). Returns the count in effect."""
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be an integer >= 1, got {num_threads!r}")
        want = num_threads
    else:
        want = min(INITIAL_THREADS, available_cpus())
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
    return want


class ThreadTuner:
    """Between engine steps, the thread count that runs a step fastest now: ``full`` (all granted CPUs) or
    ``full // 2``. Every ``explore_every`` steps one step runs with the other count; if it is faster than the step
    just before it by ``margin``, with the same number of rows, the tuner switches. A quiet machine keeps all its
    threads (an explored step with half of them is slower); beside a busy process the half that has the CPUs to
    itself wins, until the neighbour leaves and the full count wins back. Only steps of at most ``max_rows`` rows
    are tuned: the few-row kernels give bitwise the same result with any thread count (each output is summed by
    one thread), while larger steps go through torch's GEMM, whose rounding may depend on it; they always run
    with ``full``."""

    def __init__(self, full: int, max_rows: int, explore_every: int = 32, margin: float = 0.85) -> None:
        self.full, self.half, self.max_rows = full, max(1, full // 2), max_rows
        self.explore_every, self.margin = explore_every, margin
        self.current = full
        self.steps = 0
        self.last: tuple[int, int, float] | None = None  # (rows, threads, seconds) of the previous tuned step
        self.num_switches = 0

    def threads_for(self, rows: int) -> int:
        """The count to run a step of ``rows`` rows with; sets torch's."""
        n = self.full
        if rows <= self.max_rows:
            self.steps += 1
            n = self.current
            if self.steps % self.explore_every == 0:
                n = self.half if n == self.full else self.full
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def observe(self, rows: int, threads: int, seconds: float) -> None:
        """Record a step's time; an explored count that beat the step before it becomes the current one."""
        if rows > self.max_rows:
            self.last = None
            return
        last = self.last
        if last is not None and last[0] == rows and last[1] == self.current and threads != self.current \
                and seconds < last[2] * self.margin:
            self.current = threads
            self.num_switches += 1
        self.last = (rows, threads, seconds)

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
then picks, between engine steps, whether all those threads or half of them decode faster right now: it probes
the other count when the OS says a neighbour wants our CPUs (:mod:`leapdecode.cpu_load`) or the step time jumps,
and decides on the medians of steps timed once the change has settled (docs/threads.md has the measurements).

Measured with ``python -m leapdecode.eval.contention`` on the 2-vCPU AMD EPYC (Zen 5) of 2026-12-01, a 1.1B
Q4_K_M model, batch 1, tok/s: OpenMP's default waits (spinning, then sleeping) give 39.4 quiet but 11.2 beside
one busy process with 2 threads, while 1 thread keeps 21.4 there (it gets the core the neighbour leaves).
Sleeping waits (``OMP_WAIT_POLICY=PASSIVE``) kept 20.6 beside the neighbour but cost 13% on the quiet machine
(32.5, a futex wake-up per parallel region), so we leave OpenMP's waits as they are and change the count.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leapdecode.cpu_load import CpuCounters, read_counters

CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
# torch's count when leapdecode was imported (OMP_NUM_THREADS or the user's own torch.set_num_threads): engines
# change torch's count as they run (ThreadTuner), so a later engine must not take that for the user's choice
INITIAL_THREADS = torch.get_num_threads()
RECENT = 5  # steps whose median is a count's current level (an odd count: one or two odd steps cannot move it)
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


@dataclass
class Probe:
    """A run of steps with the other thread count: their times relative to the current count's recent median for
    the same number of rows, counted once the switch has settled."""

    threads: int
    ratios: list[float] = field(default_factory=list)
    settled_steps: int = 0


class ThreadTuner:
    """Between engine steps, the thread count that runs a step fastest now: ``full`` (all granted CPUs) or
    ``full // 2``.

    The decision is always made by timing: a *probe* runs steps with the other count and takes it if the median
    of its step times is below ``margin`` times the median of the current count's last ``RECENT`` steps of the
    same size. Steps within ``settle_s`` of any change of count are neither probe samples nor reference: an
    OpenMP thread that has just lost its work keeps spinning for libgomp's 300,000 pause rounds (12 ms measured on
    this machine's EPYC, longer on cores whose pause is slower) and a thread just woken runs ahead of the busy
    neighbour for a while, so the first steps after a change say nothing about the steps after them.

    Probes cost slower steps, so they run only when something says they may win:

    * at ``full``, when the threads' run delay (:mod:`leapdecode.cpu_load`) is at least ``busy_share`` of the
      wall time (another process wants our CPUs), or the step time jumped by ``jump`` over its settled level;
      where run delay is not reported, every ``interval`` steps;
    * at ``full // 2``, when the CPUs given up are idle again (the neighbour left), or where idle time is not
      reported, every ``interval`` steps.

    A probe that loses doubles ``interval`` (up to ``max_interval``), the least number of tuned steps before the
    next one; a switch resets it. So a quiet machine never probes, and a busy one that keeps all its threads
    (many CPUs, one shared) pays for a probe less and less often.

    Only steps of at most ``max_rows`` rows are tuned: the few-row kernels give bitwise the same result with any
    thread count (each output is summed by one thread), while larger steps go through torch's GEMM, whose
    rounding may depend on it; they always run with ``full``."""

    def __init__(self, full: int, max_rows: int, *, margin: float = 0.9, settle_s: float = 0.03,
                 probe_steps: int = 4, window: int = 8, first_interval: int = 16, max_interval: int = 1024,
                 busy_share: float = 0.1, jump: float = 1.3, sample_s: float = 0.2,
                 counters: Callable[[], CpuCounters] = read_counters,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.full, self.half, self.max_rows = full, max(1, full // 2), max_rows
        self.margin, self.settle_s, self.probe_steps, self.window = margin, settle_s, probe_steps, window
        self.first_interval, self.max_interval = first_interval, max_interval
        self.busy_share, self.jump, self.sample_s = busy_share, jump, sample_s
        self.counters, self.clock = counters, clock
        self.current = full
        self.probe: Probe | None = None
        self.interval = first_interval
        self.since_probe = 0  # tuned steps since the last probe ended (or since the start)
        self.times: dict[tuple[int, int], deque[float]] = {}  # (threads, rows) -> last settled step seconds
        self.baseline: dict[int, float] = {}  # rows -> the current count's settled median (the jump reference)
        self.jumped = False
        self.prev_threads = full
        self.settle_left = 0.0
        # the signals, over the last sample window: share of wall time our threads waited for a CPU, idle CPUs
        self.waiting_share: float | None = None
        self.idle_cpus: float | None = None
        self.mark = (clock(), counters())
        self.reported = self.mark[1]  # which signals this machine reports (a None field: not reported)
        self.last_seen = self.mark[0]
        self.num_switches = self.num_probes = 0

    def threads_for(self, rows: int) -> int:
        """The count to run a step of ``rows`` rows with; sets torch's (which every thread pool of a CPU step
        follows: ATen's and the C++ kernels' ``at::parallel_for`` over OpenMP, MKL, oneDNN)."""
        n = self.full
        if rows <= self.max_rows:
            if self.probe is None and self.probe_due():
                self.probe = Probe(self.half if self.current == self.full else self.full)
                self.num_probes += 1
                for key in [k for k in self.times if k[0] == self.probe.threads]:
                    del self.times[key]  # that count's old times are from another state of the machine
            n = self.current if self.probe is None else self.probe.threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def probe_due(self) -> bool:
        """Whether to start a probe before the next tuned step (the rules in the class docstring)."""
        if self.full == self.half:
            return False
        if self.current == self.full:
            if self.jumped:
                return self.since_probe >= self.window
            if self.since_probe < self.interval:
                return False
            if self.reported.run_delay_s is None:
                return True  # no run delay reported here: probe on the interval alone
            return self.waiting_share is not None and self.waiting_share >= self.busy_share
        if self.since_probe < self.interval:
            return False
        if self.reported.idle_s is None:
            return True
        return self.idle_cpus is not None and self.idle_cpus >= 0.5 * (self.full - self.half)

    def observe(self, rows: int, threads: int, seconds: float) -> None:
        """Record a step's time (and, now and then, the CPU signals); a probe that has enough samples decides."""
        changed = threads != self.prev_threads
        if changed:
            self.settle_left = self.settle_s
        settled = not changed and self.settle_left <= 0
        self.settle_left -= seconds
        self.prev_threads = threads
        self.sample_signals()
        if rows > self.max_rows:
            return
        self.since_probe += 1
        probe = self.probe
        if probe is not None and threads == probe.threads:
            if settled:
                probe.settled_steps += 1
                ref = self.recent_level(self.current, rows)
                if ref is not None:
                    probe.ratios.append(seconds / ref)
                self.record(threads, rows, seconds)
            if len(probe.ratios) >= self.probe_steps or probe.settled_steps >= 4 * self.probe_steps:
                self.finish_probe()
        elif threads == self.current and settled:
            self.record(threads, rows, seconds)
            self.check_jump(rows)

    def record(self, threads: int, rows: int, seconds: float) -> None:
        self.times.setdefault((threads, rows), deque(maxlen=self.window)).append(seconds)

    def recent_level(self, threads: int, rows: int) -> float | None:
        """The median of the last ``RECENT`` settled steps of ``rows`` rows with ``threads`` threads (the level a
        probe is compared with: a window's older steps may be from before the machine changed), if there are."""
        times = self.times.get((threads, rows))
        if times is None or len(times) < RECENT:
            return None
        return statistics.median(list(times)[-RECENT:])

    def check_jump(self, rows: int) -> None:
        """At ``full``: whether the step time has risen by ``jump`` over its settled level (a neighbour came):
        the level is the median of the first full window after a probe, the rise that of the last ``RECENT``."""
        times = self.times[(self.current, rows)]
        if self.current != self.full or len(times) < self.window:
            return
        level = self.baseline.setdefault(rows, statistics.median(times))
        recent = self.recent_level(self.current, rows)
        if recent is not None and recent > self.jump * level:
            self.jumped = True

    def finish_probe(self) -> None:
        probe = self.probe
        assert probe is not None
        if len(probe.ratios) >= max(2, self.probe_steps // 2) and statistics.median(probe.ratios) < self.margin:
            self.current = probe.threads  # its window holds the probe's steps only (cleared when it began)
            self.num_switches += 1
            self.interval = self.first_interval
        else:
            self.interval = min(2 * self.interval, self.max_interval)
            for key in [k for k in self.times if k[0] == self.current]:
                del self.times[key]  # the level after the probe is taken from the steps after it
        self.probe = None
        self.since_probe = 0
        self.jumped = False
        self.baseline.clear()

    def sample_signals(self) -> None:
        """Every ``sample_s`` of wall time, the run-delay share and idle CPUs since the last reading. A gap of over
        a second without steps (an idle engine) starts a new window instead: it says nothing about decoding."""
        now = self.clock()
        if now - self.last_seen > 1.0:
            self.mark = (now, self.counters())
        self.last_seen = now
        t0, c0 = self.mark
        if now - t0 < self.sample_s:
            return
        c1 = self.counters()
        wall = now - t0
        self.waiting_share = None if c0.run_delay_s is None or c1.run_delay_s is None else \
            max(0.0, c1.run_delay_s - c0.run_delay_s) / wall
        self.idle_cpus = None if c0.idle_s is None or c1.idle_s is None else max(0.0, c1.idle_s - c0.idle_s) / wall
        self.mark = (now, c1)

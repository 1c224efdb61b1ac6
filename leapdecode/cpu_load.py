"""What the operating system says about the CPUs this process computes on: how long its threads waited for a CPU
while they were ready to run, and how long the CPUs it may use sat idle. :class:`leapdecode.threads.ThreadTuner`
reads both to tell a busy neighbour from a quiet machine without timing anything itself.

* **Run delay** (``/proc/self/task/*/schedstat``, second field, nanoseconds): the time each thread spent runnable
  but not running. On a quiet machine a decode step's threads each have a CPU and it stays near zero; beside a
  process that keeps a CPU busy, the OpenMP threads take turns with it and their delay grows by a large share of
  the wall time (2-vCPU EPYC, bundled model, two threads: 0.00-0.01 of the wall time quiet, 0.50 beside one busy
  process; one thread: 0.00 in both, it has the other CPU to itself; docs/threads.md).
* **Idle time** (``/proc/stat``, the ``idle`` and ``iowait`` columns of each ``cpuN`` line in this process's
  affinity mask, in clock ticks): how many of those CPUs nobody used. With fewer threads than CPUs, an idle CPU
  says the neighbour that took it has left.

Both are cumulative counters; callers take differences over a window. Either is None where the kernel does not
provide it (not Linux, schedstat compiled out), and the tuner then falls back on timing alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TASKS = Path("/proc/self/task")
PROC_STAT = Path("/proc/stat")
CLOCK_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


@dataclass(frozen=True)
class CpuCounters:
    """One reading: summed run delay of this process's threads, and idle time of the CPUs it may use (seconds)."""

    run_delay_s: float | None
    idle_s: float | None


def run_delay_seconds(tasks: Path = TASKS) -> float | None:
    """Seconds this process's threads have spent ready to run but waiting for a CPU, summed over the threads alive
    now (a thread that exits takes its share with it: callers clamp a window's difference at zero)."""
    total, seen = 0, False
    try:
        names = os.listdir(tasks)
    except OSError:
        return None
    for name in names:
        try:
            fields = (tasks / name / "schedstat").read_text().split()
            total += int(fields[1])
            seen = True
        except (OSError, IndexError, ValueError):
            continue  # the thread exited meanwhile, or no schedstat
    return total / 1e9 if seen else None


def idle_seconds(cpus: set[int] | None = None, stat: Path = PROC_STAT) -> float | None:
    """Idle plus iowait seconds since boot of the CPUs in ``cpus`` (default: this process's affinity mask)."""
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            return None
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    ticks, seen = 0, False
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        fields = line.split()
        try:
            cpu = int(fields[0][3:])
            if cpu in cpus:
                ticks += int(fields[4]) + int(fields[5])
                seen = True
        except (IndexError, ValueError):
            continue
    return ticks * CLOCK_TICK_S if seen else None


def read_counters() -> CpuCounters:
    """Both counters now (two small procfs reads per thread and one of /proc/stat: ~0.1 ms; the tuner takes one
    reading every fifth of a second or so)."""
    return CpuCounters(run_delay_seconds(), idle_seconds())

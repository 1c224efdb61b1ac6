"""Thread counts from the CPUs actually granted (affinity mask, cgroup quota), --threads / LLM(num_threads=...),
and short OpenMP spins set before torch loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from leapdecode import threads
from leapdecode.cli import build_parser

REPO = Path(__file__).resolve().parents[1]


def test_cgroup_quota_v2_and_v1(tmp_path: Path) -> None:
    v2, q, p = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    v2.write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(v2, q, p) is None
    v2.write_text("150000 100000\n")
    assert threads.cgroup_cpu_limit(v2, q, p) == 1.5
    v2.unlink()  # no v2 file: cgroup v1's cfs quota / period
    q.write_text("-1\n")
    p.write_text("100000\n")
    assert threads.cgroup_cpu_limit(v2, q, p) is None
    q.write_text("200000\n")
    assert threads.cgroup_cpu_limit(v2, q, p) == 2.0
    assert threads.cgroup_cpu_limit(v2, tmp_path / "none", p) is None


def test_available_cpus_is_the_affinity_mask_capped_by_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 2.0)
    assert threads.available_cpus() == 2  # a 2-CPU container on a 64-CPU host
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 1.5)
    assert threads.available_cpus() == 2  # a fractional quota still runs 2 threads at once, part of the time
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 0.2)
    assert threads.available_cpus() == 1
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert threads.available_cpus() == 1  # taskset -c 3


def test_configure_lowers_to_the_granted_cpus_and_takes_an_explicit_count(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "available_cpus", lambda: 2)
        monkeypatch.setattr(threads, "INITIAL_THREADS", 4)
        torch.set_num_threads(1)  # e.g. left by another engine's tuner: not the user's choice
        assert threads.configure() == 2 and torch.get_num_threads() == 2
        monkeypatch.setattr(threads, "INITIAL_THREADS", 1)
        assert threads.configure() == 1  # a lower count the user chose before import (OMP_NUM_THREADS) is kept
        assert threads.configure(3) == 3 and torch.get_num_threads() == 3  # explicit: what was asked
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="num_threads"):
                threads.configure(bad)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(before)


class Machine:
    """A simulated 2-CPU machine for the tuner: step times per thread count, the spin tail after a count change,
    and the counters the tuner reads (run delay of our threads, idle time of our CPUs), all advanced by the
    simulated steps. ``busy``: one process keeps a CPU busy."""

    def __init__(self, reports: bool = True) -> None:
        self.now = self.delay = self.idle = 0.0
        self.reports = reports
        self.busy = False
        self.quiet_cost = {2: 0.004, 1: 0.0065}  # quiet: two threads decode faster
        self.busy_cost = {2: 0.016, 1: 0.0065}  # beside a busy process: two threads wait at every barrier
        self.tail = {1: (0.012, 0.013)}  # the 12 ms after 2 -> 1 while the idle thread still spins: 13 ms steps
        self.lucky = {2: (0.004, 0.004)}  # the 4 ms after 1 -> 2: the woken thread runs ahead of the neighbour
        self.prev, self.since_change = 2, 1.0

    def clock(self) -> float:
        return self.now

    def counters(self) -> threads.CpuCounters:
        return threads.CpuCounters(self.delay if self.reports else None, self.idle if self.reports else None)

    def step(self, n: int) -> float:
        if n != self.prev:
            self.prev, self.since_change = n, 0.0
        dt = (self.busy_cost if self.busy else self.quiet_cost)[n]
        transient = (self.tail if n == 1 else self.lucky).get(n)
        if self.busy and transient and self.since_change < transient[0]:
            dt = transient[1]
        self.since_change += dt
        self.now += dt + 0.0002  # sampling and scheduling between steps
        share = (0.6 if n == 2 else 0.0) if self.busy else 0.0
        idle = 0.0 if self.busy else float(2 - n)
        self.delay += share * dt
        self.idle += idle * dt
        return dt


def make_tuner(m: Machine, **kw) -> threads.ThreadTuner:
    return threads.ThreadTuner(2, 64, counters=m.counters, clock=m.clock, **kw)


def drive(tuner: threads.ThreadTuner, m: Machine, steps: int, rows: int = 1) -> list[int]:
    used = []
    for _ in range(steps):
        n = tuner.threads_for(rows)
        assert torch.get_num_threads() == n
        tuner.observe(rows, n, m.step(n))
        used.append(n)
    return used


@pytest.fixture
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("keep_torch_threads")
def test_quiet_machine_never_probes_when_run_delay_is_reported() -> None:
    m = Machine()
    tuner = make_tuner(m)
    used = drive(tuner, m, 3000)
    assert set(used) == {2} and tuner.num_probes == 0 and tuner.waiting_share == 0.0


@pytest.mark.usefixtures("keep_torch_threads")
def test_busy_neighbour_moves_to_half_through_the_spin_tail_and_stays() -> None:
    m = Machine()
    tuner = make_tuner(m)
    drive(tuner, m, 300)
    m.busy = True  # the neighbour arrives: run delay rises, and the step time jumps
    used = drive(tuner, m, 200)
    assert tuner.current == 1 and tuner.num_switches == 1
    switched_at = used.index(1)
    assert switched_at < 60  # within a sample window, the 30 ms settle and 4 probe steps
    # the first steps with one thread ran in the spin tail (13 ms, slower than nothing): not counted against it
    assert tuner.waiting_share is not None
    used = drive(tuner, m, 3000)
    assert tuner.current == 1 and tuner.num_switches == 1
    assert used.count(2) == 0  # the CPUs stay busy (no idle time): no probe back to two threads


@pytest.mark.usefixtures("keep_torch_threads")
def test_a_long_spin_tail_is_waited_out() -> None:
    # a core whose pause instruction is slower spins longer: 24 ms of one-thread steps slower than two threads'
    m = Machine()
    m.busy = True
    m.tail = {1: (0.024, 0.018)}
    tuner = make_tuner(m)
    drive(tuner, m, 300)
    assert tuner.current == 1
    tail_ratio = 0.018 / 0.016
    assert tail_ratio > 1  # counted, the tail steps would have lost the probe
    m2 = Machine()
    m2.busy = True
    m2.tail = {1: (0.024, 0.018)}
    # the former rule: one explored step (the first after the change left out) against the step before it
    tuner2 = make_tuner(m2, settle_s=0.0, probe_steps=1, max_interval=16)
    drive(tuner2, m2, 300)
    assert tuner2.current == 2 and tuner2.num_probes > 10


@pytest.mark.usefixtures("keep_torch_threads")
def test_neighbour_leaving_frees_a_cpu_and_two_threads_come_back() -> None:
    m = Machine()
    m.busy = True
    tuner = make_tuner(m)
    drive(tuner, m, 200)
    assert tuner.current == 1
    m.busy = False  # our second CPU goes idle
    drive(tuner, m, 200)
    assert tuner.current == 2 and tuner.num_switches == 2
    probes = tuner.num_probes
    drive(tuner, m, 2000)
    assert tuner.current == 2 and tuner.num_probes == probes  # quiet again: no more probes


@pytest.mark.usefixtures("keep_torch_threads")
def test_woken_thread_running_ahead_does_not_win_a_probe_back() -> None:
    m = Machine()
    m.busy = True
    m.idle = 0.0
    tuner = make_tuner(m, max_interval=64)
    drive(tuner, m, 200)
    assert tuner.current == 1
    m.reports = False  # no idle signal: periodic probes of two threads, whose first 4 ms run fast
    tuner.reported = threads.CpuCounters(None, None)
    used = drive(tuner, m, 2000)
    assert tuner.current == 1 and tuner.num_switches == 1 and used.count(2) > 0


@pytest.mark.usefixtures("keep_torch_threads")
def test_losing_probes_back_off() -> None:
    m = Machine()
    m.busy = True
    m.busy_cost = {2: 0.005, 1: 0.0065}  # run delay is high, yet two threads still win (many CPUs, one shared)
    tuner = make_tuner(m, max_interval=256)
    used = drive(tuner, m, 4000)
    assert tuner.current == 2 and tuner.num_switches == 0
    assert 3 <= tuner.num_probes <= 30 and tuner.interval == 256
    assert used.count(1) < 0.05 * len(used)


@pytest.mark.usefixtures("keep_torch_threads")
def test_without_counters_timing_alone_probes_on_an_interval() -> None:
    m = Machine(reports=False)
    tuner = make_tuner(m)
    used = drive(tuner, m, 3000)
    assert tuner.current == 2 and tuner.num_switches == 0 and 0 < tuner.num_probes <= 10
    assert used.count(1) < 0.03 * len(used)  # the backoff keeps the quiet machine's cost small
    m.busy = True
    drive(tuner, m, 400)  # the jump in step time probes at once
    assert tuner.current == 1


@pytest.mark.usefixtures("keep_torch_threads")
def test_step_time_jump_probes_without_run_delay() -> None:
    m = Machine()
    tuner = make_tuner(m)
    drive(tuner, m, 300)
    m.quiet_cost = {2: 0.012, 1: 0.0065}  # slower with two threads, yet no run delay (e.g. threads of our own)
    used = drive(tuner, m, 100)
    assert tuner.current == 1 and tuner.num_switches == 1
    assert used.index(1) <= 12  # the jump is seen after half a window of slower steps


@pytest.mark.usefixtures("keep_torch_threads")
def test_large_steps_run_with_every_thread_and_other_sizes_are_no_reference() -> None:
    m = Machine()
    m.busy = True
    tuner = make_tuner(m)
    drive(tuner, m, 200)
    assert tuner.current == 1
    assert tuner.threads_for(65) == 2  # larger steps (torch GEMM) always run with every thread
    tuner.observe(65, 2, 0.5)
    assert tuner.threads_for(1) == 1
    probe = threads.Probe(2)
    tuner.probe = probe
    tuner.settle_left = 0.0
    tuner.prev_threads = 2
    tuner.observe(7, 2, 0.0001)  # a 7-row step: no 7-row reference at one thread, so no ratio
    assert probe.ratios == [] and probe.settled_steps == 1


def test_engine_tunes_threads_only_when_the_caller_did_not_choose(tiny_model_dir, monkeypatch) -> None:
    from leapdecode import LLM

    before = torch.get_num_threads()
    try:
        chosen = LLM(model=str(tiny_model_dir), kv_cache_blocks=32, num_threads=1)
        assert chosen.engine.thread_tuner is None
        if threads.available_cpus() > 1:
            monkeypatch.setattr(threads, "INITIAL_THREADS", threads.available_cpus())  # the suite runs 1 thread
            auto = LLM(model=str(tiny_model_dir), kv_cache_blocks=32)
            assert auto.engine.thread_tuner is not None and auto.engine.thread_tuner.full == auto.engine.num_threads
    finally:
        torch.set_num_threads(before)


def test_threads_flag_on_every_model_command() -> None:
    parser = build_parser()
    for argv in (["generate", "hi"], ["chat"], ["serve"], ["bench"]):
        assert parser.parse_args(argv).threads is None
        assert parser.parse_args([*argv, "--threads", "3"]).threads == 3
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in ("generate", "chat", "serve", "bench"):
        assert "cgroup CPU quota" in sub.choices[name].format_help()


def test_llm_num_threads(tiny_model_dir: Path) -> None:
    from leapdecode import LLM

    before = torch.get_num_threads()
    try:
        llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=8, num_threads=2)
        assert llm.engine.num_threads == 2 == torch.get_num_threads()
        with pytest.raises(ValueError, match="num_threads"):
            LLM(model=str(tiny_model_dir), kv_cache_blocks=8, num_threads=0)
    finally:
        torch.set_num_threads(before)


def test_cpu_counters_read_schedstat_and_proc_stat(tmp_path: Path) -> None:
    from leapdecode import cpu_load

    tasks = tmp_path / "task"
    for tid, line in (("10", "5000 2500000000 7\n"), ("11", "100 500000000 3\n"), ("12", "garbage\n")):
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "schedstat").write_text(line)
    assert cpu_load.run_delay_seconds(tasks) == pytest.approx(3.0)  # 2.5 s + 0.5 s waiting for a CPU
    assert cpu_load.run_delay_seconds(tmp_path / "none") is None
    (tasks / "13").mkdir()  # a thread without schedstat (compiled out): skipped
    assert cpu_load.run_delay_seconds(tasks) == pytest.approx(3.0)
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 1 2 3 400 50 0 0 0 0 0\ncpu1 1 2 3 1000 0 0 0 0 0 0\n"
                    "cpu2 1 2 3 7000 0 0 0 0 0 0\nintr 1 2 3\n")
    tick = cpu_load.CLOCK_TICK_S
    assert cpu_load.idle_seconds({0, 1}, stat) == pytest.approx(1450 * tick)  # idle + iowait of cpu0 and cpu1
    assert cpu_load.idle_seconds({5}, stat) is None
    assert cpu_load.idle_seconds({0}, tmp_path / "none") is None
    if Path("/proc/self/schedstat").exists() and Path("/proc/stat").exists():  # Linux with schedstat: both read
        real = cpu_load.read_counters()
        assert real.run_delay_s is not None and real.run_delay_s >= 0 and real.idle_s is not None

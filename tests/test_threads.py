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


def test_thread_tuner_moves_to_the_count_that_runs_faster_and_back() -> None:
    before = torch.get_num_threads()
    try:
        tuner = threads.ThreadTuner(full=2, max_rows=64, explore_every=4, margin=0.85)
        cost = {2: 1.0, 1: 1.8}  # quiet machine: half the threads is slower

        def run(steps: int, rows: int = 1) -> list[int]:
            used = []
            for _ in range(steps):
                n = tuner.threads_for(rows)
                assert torch.get_num_threads() == n
                tuner.observe(rows, n, cost[n])
                used.append(n)
            return used

        used = run(16)
        assert tuner.current == 2 and used.count(1) == 4  # explored every 4th step, never taken
        cost[2] = 4.0  # a busy neighbour takes one CPU: two threads wait at every barrier
        run(8)
        assert tuner.current == 1 and tuner.num_switches == 1
        cost[2] = 1.0  # the neighbour leaves
        run(8)
        assert tuner.current == 2 and tuner.num_switches == 2
        assert tuner.threads_for(65) == 2  # larger steps (torch GEMM) always run with every thread
        tuner.current = 1
        assert tuner.threads_for(200) == 2
        tuner.observe(5, 1, 0.1)
        tuner.observe(6, 2, 0.01)  # a step of another size is no comparison
        assert tuner.current == 1
    finally:
        torch.set_num_threads(before)


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

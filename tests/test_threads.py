"""Thread counts from the CPUs actually granted (affinity mask, cgroup quota), --threads / LLM(num_threads=...),
and short OpenMP spins set before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys
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
        torch.set_num_threads(4)
        assert threads.configure() == 2 and torch.get_num_threads() == 2
        torch.set_num_threads(1)
        assert threads.configure() == 1  # a lower count already chosen (by the user, OMP_NUM_THREADS) is kept
        assert threads.configure(3) == 3 and torch.get_num_threads() == 3  # explicit: what was asked
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="num_threads"):
                threads.configure(bad)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(before)


def test_wait_defaults_never_override_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(key, raising=False)
    threads.set_wait_defaults()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    threads.set_wait_defaults()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")  # a spin count chosen by the user: no policy on top of it
    threads.set_wait_defaults()
    assert "OMP_WAIT_POLICY" not in os.environ and os.environ["GOMP_SPINCOUNT"] == "7"


def test_import_sets_the_wait_policy_before_torch_loads() -> None:
    # the OpenMP runtime reads its settings when torch loads it: leapdecode must set them before importing torch
    code = (
        "import os, sys\n"
        "seen = []\n"
        "class Watch:\n"  # records the policy in the environment at the moment torch starts to import
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' and not seen:\n"
        "            seen.append(os.environ.get('OMP_WAIT_POLICY'))\n"
        "        return None\n"
        "sys.meta_path.insert(0, Watch())\n"
        "import leapdecode\n"
        "print(seen[0])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "PASSIVE"


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

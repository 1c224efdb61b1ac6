"""Kernel builds cannot wedge later runs: a build killed midway (SIGKILL) leaves torch's lock file behind, and the
next run must still build (or load) in its normal time; a process that waits says for whom and gives up.

The extension here is a tiny CPython module of the test's own (no torch headers), so a build takes seconds."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from leapdecode.kernels.build import FLOCK_NAME, TORCH_LOCK_NAME, KernelBuildTimeout, load_extension

REPO = Path(__file__).resolve().parents[1]
NAME = "leapdecode_build_probe"
SOURCE = """
#include <Python.h>
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "42"}, {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "NAME", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_NAME(void) { return PyModule_Create(&module); }
""".replace("NAME", NAME)
# builds the probe and prints its answer; run in a child so that it can be killed
CHILD = textwrap.dedent(
    f"""
    import sys
    from leapdecode.kernels.build import load_extension
    ext = load_extension({NAME!r}, [sys.argv[1]], what="the probe", wait_s=float(sys.argv[2]))
    print("answer", ext.answer(), flush=True)
    """
)
# a compiler that stalls before compiling (so the build can be killed while torch holds its lock); other calls
# (version probes) go straight through
SLOW_CXX = """#!/bin/sh
case " $* " in *" -c "*) touch "$STARTED"; sleep 120 ;; esac
exec c++ "$@"
"""


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    ext_dir = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext_dir))
    src = tmp_path / "probe.cpp"
    src.write_text(SOURCE)
    cxx = tmp_path / "slow-cxx"
    cxx.write_text(SLOW_CXX)
    cxx.chmod(0o755)
    return {"dir": ext_dir, "src": src, "cxx": cxx, "started": tmp_path / "started"}


def child_env(ws: dict[str, Path], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CXX"}  # the real compiler unless ``extra`` says otherwise
    env.update(PYTHONPATH=str(REPO), TORCH_EXTENSIONS_DIR=str(ws["dir"]), **extra)
    return env


def test_a_killed_build_does_not_block_the_next(workspace: dict[str, Path]) -> None:
    ws = workspace
    env = child_env(ws, CXX=str(ws["cxx"]), STARTED=str(ws["started"]))
    first = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ws["src"]), "60"], env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not ws["started"].exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first build never reached the compiler"
            time.sleep(0.1)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the child, ninja and the stalled compiler: a kill -9 mid-build
        first.wait(30)
    folder = ws["dir"] / NAME
    assert (folder / TORCH_LOCK_NAME).exists(), "the killed build should have left torch's lock file behind"
    start = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-c", CHILD, str(ws["src"]), "5"], env=child_env(ws),
        capture_output=True, text=True, timeout=180,
    )
    took = time.monotonic() - start
    assert second.returncode == 0, second.stderr[-2000:]
    assert "answer 42" in second.stdout
    assert "left by a build that was killed" in second.stderr
    assert not (folder / TORCH_LOCK_NAME).exists()
    # a third run loads what the second built, without waiting or rebuilding
    third = subprocess.run(
        [sys.executable, "-c", CHILD, str(ws["src"]), "5"], env=child_env(ws),
        capture_output=True, text=True, timeout=120,
    )
    assert third.returncode == 0 and "answer 42" in third.stdout, third.stderr[-2000:]
    assert "waiting" not in third.stderr
    print(f"rebuild after the kill took {took:.1f} s")


def test_a_waiter_names_the_holder_and_gives_up(workspace: dict[str, Path], capfd: pytest.CaptureFixture) -> None:
    ws = workspace
    folder = ws["dir"] / NAME
    folder.mkdir(parents=True)
    fd = os.open(folder / FLOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a live builder: this test process
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        start = time.monotonic()
        with pytest.raises(KernelBuildTimeout, match=f"process {os.getpid()} .*{FLOCK_NAME}"):
            load_extension(NAME, [str(ws["src"])], what="the probe", wait_s=1.0)
        assert 1.0 <= time.monotonic() - start < 10
        err = capfd.readouterr().err
        assert f"waiting for process {os.getpid()} to finish building the probe" in err
    finally:
        os.close(fd)

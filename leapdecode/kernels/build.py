"""Building a C++ extension on first use without ever wedging later runs.

``torch.utils.cpp_extension.load`` guards a build with a plain ``lock`` file in the build folder, which it deletes
when the build ends. A build that is killed (closed terminal, OOM kill, container stop, CI timeout, ``kill -9``)
never deletes it, and every later process then waits for it forever, silently. :func:`load_extension` puts an OS
lock in front: ``fcntl.flock`` on ``leapdecode.flock`` in the same folder. The kernel releases a flock when its
owner dies, however it dies, so:

* holding the flock means no other leapdecode process is building, hence a ``lock`` file still present is stale
  (left by a killed build) and is removed before torch looks at it;
* a process that has to wait says whom it waits for (the holder's PID and the lock file), and gives up after a
  bound with an error naming the file, instead of hanging.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

# a cold build of the real kernels takes ~90 s on a quiet 2-core machine and several times that beside a busy
# neighbour; 20 minutes is far beyond any healthy build and still ends a wait that would never end
DEFAULT_WAIT_S = float(os.environ.get("LEAPDECODE_BUILD_WAIT_S", "1200"))
FLOCK_NAME = "leapdecode.flock"
TORCH_LOCK_NAME = "lock"  # the file torch's FileBaton creates in the build folder
POLL_S = 0.2


class KernelBuildTimeout(RuntimeError):
    """Another process held the build lock for longer than the wait bound."""


def build_directory(name: str) -> Path:
    """The folder torch builds extension ``name`` in (``TORCH_EXTENSIONS_DIR`` or torch's default); created."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _holder(fd: int) -> str:
    """The PID the current holder wrote into the lock file, as text ("unknown" before it has written it)."""
    try:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        pid = ""
    return pid or "unknown"


def _acquire(fd: int, lock_path: Path, what: str, wait_s: float) -> None:
    """Take the exclusive flock on ``fd``, polling so that the wait is announced and bounded."""
    start = time.monotonic()
    announced = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        if waited >= wait_s:
            raise KernelBuildTimeout(
                f"gave up after {waited:.0f} s waiting for process {_holder(fd)} to finish building {what} "
                f"(lock file {lock_path}); if that process is stuck, stop it and run again "
                "(the lock is released when its owner exits)"
            )
        if not announced:
            print(
                f"leapdecode: waiting for process {_holder(fd)} to finish building {what} "
                f"(lock file {lock_path}, giving up after {wait_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            announced = True
        time.sleep(POLL_S)


def load_extension(
    name: str,
    sources: Sequence[str],
    what: str | None = None,
    wait_s: float = DEFAULT_WAIT_S,
    **load_kwargs: Any,
) -> ModuleType:
    """``torch.utils.cpp_extension.load(name, sources, **load_kwargs)`` under an OS lock that dies with its owner.

    Builds (or loads the already built) extension; ``what`` names it in messages. Waits at most ``wait_s`` seconds
    for another process that is building it, then raises :class:`KernelBuildTimeout`."""
    from torch.utils.cpp_extension import load

    folder = build_directory(name)
    lock_path = folder / FLOCK_NAME
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, lock_path, what or name, wait_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        stale = folder / TORCH_LOCK_NAME
        if stale.exists():
            # nobody else can be inside torch's build now (they would hold the flock): a killed build left it
            print(f"leapdecode: removing {stale}, left by a build that was killed", file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        return load(name=name, sources=list(sources), build_directory=str(folder), **load_kwargs)
    finally:
        os.close(fd)  # closing the last descriptor releases the flock

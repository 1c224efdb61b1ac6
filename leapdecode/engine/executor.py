"""Tensor parallelism's process machinery on rank 0: start the other ranks, keep them in step, notice when one dies.

Every rank runs a whole engine (scheduler, speculator, sampler) over its shard of the model; the ranks meet only
in the collectives inside the layers (one all-reduce per attention block and per MLP block, the embedding's sum,
the LM head's gather). Rank 0 owns the requests: ``add_request`` and ``abort_request`` are queued here and sent
to the workers with the next step, so every rank's scheduler sees the same requests in the same order and plans
the same batch; every rank's sampler draws from the same logits (the gather leaves identical copies) with
identically seeded generators, so every rank emits the same tokens. Each step message carries rank 0's digest of
its previous step's tokens; a worker whose own digest differs stops with an error naming the step instead of
running on out of step. Timings that steer decisions (the speculative cost model) are rank 0's
(``parallel.rank0_value``).

Failure handling: a watchdog thread waits on the workers' process sentinels; a worker that exits (crash, kill,
divergence) marks the executor failed, the other workers are stopped, and the next ``step`` (or the collective
rank 0 is blocked in, which fails as soon as the dead rank's sockets close, else after the group timeout) raises
``WorkerDiedError`` naming the rank, its exit code and the worker's own error. Workers die with rank 0
(the closed pipe, and ``PR_SET_PDEATHSIG`` when the engine was built in the main thread), ignore Ctrl-C (rank 0's
to handle), and ``shutdown`` stops and reaps them, so no process outlives the engine. The worker side is
``engine/worker.py``.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from leapdecode import parallel
from leapdecode.config import EngineConfig
from leapdecode.engine.worker import Command, EngineFactory, run_worker, step_digest
from leapdecode.outputs import RequestOutput

# one thread at a time waits for (reaps) workers: a process reaped by one thread reads as still running (exit code
# None) to another that waits on it at the same moment
_REAP_LOCK = threading.RLock()


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank stopped: the engine cannot run without it."""


def cpu_shares(size: int) -> list[set[int]]:
    """The CPUs this process may use, split into ``size`` contiguous shares (one per rank); with fewer CPUs than
    ranks, ranks share them round-robin."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cpus) < size:
        return [{cpus[r % len(cpus)]} for r in range(size)]
    per = len(cpus) // size
    return [set(cpus[r * per: (r + 1) * per]) for r in range(size)]


def start_tensor_parallel(config: EngineConfig, engine: EngineFactory) -> Executor | None:
    """Make this process rank 0 of a group of ``config.tensor_parallel_size``: the executor that started the other
    ranks (each builds ``engine(config)``, the engine class, passed in so that this module need not import it), or
    None when the group already exists (a worker, or a process torchrun started, which joins here)."""
    size = config.tensor_parallel_size
    device = torch.device(config.device)
    have = parallel.group_size()
    if have > 1:
        if have != size:
            raise ValueError(f"tensor_parallel_size={size} but this process is in a group of {have}")
        if parallel.tp_rank() == 0 and not parallel.launched_by_torchrun():
            raise ValueError("this process already runs a tensor-parallel engine: shut it down (LLM.shutdown()) "
                             "before starting another")
        return None
    if parallel.launched_by_torchrun():
        parallel.init_tensor_parallel(int(os.environ["RANK"]), size, None, device)
        return None
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, {torch.cuda.device_count()} visible")
    return Executor(config, engine)


class Executor:
    """Rank 0's side: the worker processes, their pipes, the watchdog and the per-step messages."""

    def __init__(self, config: EngineConfig, engine: EngineFactory) -> None:
        size = config.tensor_parallel_size
        self.size = size
        self.pending: list[Command] = []
        self.last_digest: int | None = None
        self.failure: str | None = None
        self.closed = False
        self._lock = threading.Lock()
        self._failed = threading.Event()  # set once ``failure`` is
        timeout = timedelta(seconds=parallel.DEFAULT_TIMEOUT_S)
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
        device = torch.device(config.device)
        shares = cpu_shares(size) if device.type == "cpu" else [set() for _ in range(size)]
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        # an engine dropped without shutdown(): the workers are reaped and the group left when it is collected (the
        # watchdog holds only a weak reference), or at interpreter exit; set before the first start, so a start
        # that fails half-way leaves none behind either
        self._finalizer = weakref.finalize(self, _close, self.procs, self.conns)
        atexit.register(self._finalizer)
        # Linux's parent-death signal follows the thread that started the child: only the main thread outlives
        # the engine, so workers started from another thread rely on the closed pipe alone
        parent = os.getpid() if threading.current_thread() is threading.main_thread() else None
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=run_worker, name=f"leapdecode-tp{rank}", daemon=True,
                               args=(engine, rank, size, self.store.port, config, theirs, shares[rank], parent))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        self._watchdog = threading.Thread(target=_watch, args=(weakref.ref(self), list(self.procs)),
                                          name="leapdecode-tp-watchdog", daemon=True)
        self._watchdog.start()
        self.own_cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        if shares[0] and self.own_cpus:
            os.sched_setaffinity(0, shares[0])  # this rank's share (given back at shutdown); workers take theirs
        try:
            parallel.init_tensor_parallel(0, size, self.store, device)
        except Exception as e:
            self.shutdown()
            raise self.error(e) from e

    # ----------------------------------------------------------------------------------------- failure
    def worker_exited(self, rank: int) -> None:
        """The watchdog saw rank ``rank`` exit: unless the engine asked it to, record why and stop the others."""
        if self.closed:
            return
        proc = self.procs[rank - 1]
        with _REAP_LOCK:
            proc.join(timeout=1.0)  # reaped, so its exit code is known
        self.fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with "
                  f"{_describe_exit(proc.exitcode)}{self._worker_error(rank)}")

    def _worker_error(self, rank: int) -> str:
        """The error text a worker sent before exiting, if any."""
        conn = self.conns[rank - 1]
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "error":
                    return f": {msg[1]}"
        except (EOFError, OSError):
            pass
        return ""

    def error(self, cause: BaseException | None = None) -> WorkerDiedError:
        """The error to raise: the recorded failure, or ``cause`` (a collective that failed) explained."""
        if self.failure is None and cause is not None and not self.closed:  # (closed: the watchdog no longer reports)
            self._failed.wait(timeout=3.0)  # a collective failed before the watchdog saw the exit: give it a moment
        if self.failure is None:
            self.fail(f"tensor-parallel group failed: {cause}")
        return WorkerDiedError(f"{self.failure}; the engine has stopped (shut it down, then start a new one)")

    def fail(self, text: str) -> None:
        """Record why the group cannot go on (the first reason wins) and stop the workers."""
        with self._lock:
            if self.failure is None:
                self.failure = text
        self._failed.set()
        # the pipes stay open (the watchdog may call this while rank 0 sends): shutdown() or the finalizer closes them
        _reap(self.procs, [], grace_s=0.0)

    def check(self) -> None:
        if self.failure is not None:
            raise self.error()
        if self.closed:
            raise WorkerDiedError("the tensor-parallel engine was shut down")

    # -------------------------------------------------------------------------------------------- steps
    def queue(self, command: Command) -> None:
        """A request change (``AddRequest``, ``AbortRequest``) for the workers, sent with the next step."""
        self.pending.append(command)

    def start_step(self) -> None:
        """Send the queued request changes, rank 0's last digest and the order to step."""
        self._send("step")

    def apply_now(self, command: Command) -> None:
        """Make the workers apply ``command`` (after the queued ones) now, outside a step: for a change whose
        collectives rank 0 is about to enter (a new speculator gathers the LM head)."""
        self.queue(command)
        self._send("apply")

    def _send(self, kind: str) -> None:
        self.check()
        msg = (kind, self.pending, self.last_digest)
        self.pending = []
        try:
            for conn in self.conns:
                conn.send(msg)
        except (EOFError, OSError) as e:
            raise self.error(e) from e
        except BaseException as e:  # Ctrl-C, a message that does not pickle: some workers may have it, others not
            self.fail(f"rank 0 could not send the step order ({type(e).__name__}: {e})")
            raise

    def finish_step(self, outputs: list[RequestOutput]) -> None:
        self.last_digest = step_digest(outputs)

    def shutdown(self) -> None:
        """Stop the workers (they leave the group and exit), reap them, leave the group."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        _reap(self.procs, self.conns, grace_s=5.0)
        parallel.destroy_tensor_parallel()
        self._finalizer.detach()
        if self.own_cpus:
            os.sched_setaffinity(0, self.own_cpus)


def _watch(ref: weakref.ReferenceType[Executor], procs: list[Any]) -> None:
    """The watchdog thread: wait on the workers' sentinels and tell the executor (while it exists) who exited."""
    alive = {p.sentinel: rank for rank, p in enumerate(procs, start=1)}
    while alive:
        for s in wait(list(alive)):
            rank = alive.pop(s)  # type: ignore[call-overload]
            ex = ref()
            if ex is None:
                return
            ex.worker_exited(rank)
            del ex


def _close(procs: list[Any], conns: list[Connection]) -> None:
    """Finalizer of an executor never shut down: reap its workers and leave the group."""
    _reap(procs, conns, grace_s=0.0)
    parallel.destroy_tensor_parallel()


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _reap(procs: list[Any], conns: list[Connection], grace_s: float = 2.0) -> None:
    """Wait up to ``grace_s`` for the workers to exit, then terminate, then kill: none is left behind."""
    with _REAP_LOCK:
        for p in procs:
            p.join(timeout=grace_s)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
    for c in conns:
        c.close()

"""A tensor-parallel worker process (rank >= 1), started by ``engine/executor.py``.

It joins the process group, builds the same engine as rank 0 over its own shard, then steps whenever rank 0 says
so, after applying the request changes rank 0 sent with the order. It exits when rank 0 says stop, when rank 0's
end of the pipe closes, or (Linux) the moment rank 0's process dies (``PR_SET_PDEATHSIG``); an error is sent to
rank 0 before exiting, so the engine can say what went wrong.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Protocol

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from leapdecode import parallel
from leapdecode.config import EngineConfig, SpeculativeConfig
from leapdecode.outputs import RequestOutput
from leapdecode.sampling_params import SamplingParams
from leapdecode.structured.base import CompiledGrammar, StructuredOutputBackend

PR_SET_PDEATHSIG = 1
MAX_ERROR_CHARS = 4000


class WorkerEngine(Protocol):
    """What a worker needs of the engine (``LLMEngine``)."""

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None, grammar: CompiledGrammar | None = None) -> str: ...

    def structured_backend(self) -> StructuredOutputBackend: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def set_speculative_config(self, cfg: SpeculativeConfig | None) -> None: ...


EngineFactory = Callable[[EngineConfig], WorkerEngine]


@dataclass(frozen=True)
class AddRequest:
    """Rank 0 added a request: every rank adds it with the same id."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    prompt: str | None = None
    grammar_wire: str | None = None  # the compiled grammar, serialised (workers never compile inside a step)


@dataclass(frozen=True)
class AbortRequest:
    """Rank 0 aborted a request."""

    request_id: str


@dataclass(frozen=True)
class SetSpeculative:
    """Rank 0 switched speculative decoding (None: plain decoding)."""

    cfg: SpeculativeConfig | None


# one change rank 0 made to its engine, for every worker to make to its own
Command = AddRequest | AbortRequest | SetSpeculative


def step_digest(outputs: list[RequestOutput]) -> int:
    """A checksum of one step's tokens (request ids, each completion's token count and last tokens, finished),
    equal on every rank that made the same decisions; independent of Python's per-process string hashing."""
    text = repr([(o.request_id, [(len(c.token_ids), c.token_ids[-4:]) for c in o.outputs], o.finished)
                 for o in outputs])  # fmt: skip
    return zlib.crc32(text.encode())


def die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to kill this process when its parent (rank 0; None: not asked, see ``Executor``) dies; exit now if
    it already has. Ctrl-C is rank 0's to handle: a worker ignores it and stops when rank 0 stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pid is None:
        return
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass  # no prctl: the closed pipe still ends the worker once it next waits for an order
    if os.getppid() != parent_pid:
        os._exit(0)


def run_worker(engine: EngineFactory, rank: int, size: int, port: int, config: EngineConfig, conn: Connection,
               cpus: set[int], parent_pid: int | None) -> None:
    """The worker process's entry point."""
    die_with_parent(parent_pid)
    # quiet (rank 0 shows progress), and no multiprocessing lock in tqdm, which the fast exit below would leak
    os.environ["TQDM_DISABLE"] = "1"
    tqdm.set_lock(threading.RLock())
    code = 0
    try:
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        timeout = timedelta(seconds=parallel.DEFAULT_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
        parallel.init_tensor_parallel(rank, size, store, torch.device(config.device))
        serve(engine(config), conn, rank)
    except BaseException as e:  # noqa: BLE001 -- reported to rank 0, then the process exits non-zero
        code = 1
        traceback.print_exc()
        try:
            # short: rank 0 reads it only after this process exits, so it must fit the pipe's buffer
            conn.send(("error", f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]))
        except OSError:
            pass
    finally:
        conn.close()
    if code == 0:
        parallel.destroy_tensor_parallel()
    os._exit(code)  # skip interpreter teardown: a half-torn-down process group can block it


def serve(engine: WorkerEngine, conn: Connection, rank: int) -> None:
    """Step with rank 0 until told to stop (or rank 0 is gone); refuse to run on out of step with it."""
    digest: int | None = None
    steps = 0
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return  # rank 0 closed its end: the engine is gone
        if msg[0] == "stop":
            return
        _, commands, rank0_digest = msg
        if rank0_digest != digest:
            raise RuntimeError(f"rank {rank} emitted different tokens from rank 0 at step {steps}: the ranks have "
                               "diverged (a bug: every rank must take the same decisions)")
        for cmd in commands:
            apply(engine, cmd)
        if msg[0] == "step":
            digest = step_digest(engine.step())
            engine.take_failed()  # a request a step failed here failed on rank 0 too, which reports it
            steps += 1


def apply(engine: WorkerEngine, cmd: Command) -> None:
    """One change rank 0 made to its engine, made to this one."""
    if isinstance(cmd, AddRequest):
        so = cmd.params.structured_outputs
        wire = cmd.grammar_wire
        grammar = engine.structured_backend().from_wire(so.key(), wire) if so is not None and wire else None
        engine.add_request(cmd.prompt_token_ids, cmd.params, cmd.request_id, cmd.prompt, grammar=grammar)
    elif isinstance(cmd, AbortRequest):
        engine.abort_request(cmd.request_id)
    elif isinstance(cmd, SetSpeculative):
        engine.set_speculative_config(cmd.cfg)
    else:
        raise ValueError(f"unknown command from rank 0: {cmd!r}")

"""What every drafter trainer's loop shares: the learning-rate schedule, checkpoints, and the run's record.

Checkpoints hold no pickled Python: a run's state (weights, optimiser moments, history, schedules, settings) is
split into its tensors, saved with safetensors, and everything else, saved as JSON, where each tensor is replaced
by a reference to it. Loading joins them back, so resuming needs no ``torch.load`` at all, and a damaged or
foreign file is a clear error that says how to start over instead of a traceback deep in unpickling.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from leapdecode.speculative.artifacts import write_record

TENSOR_REF = "__tensor__"
INT_KEYS = "__int_keys__"  # a dict whose keys were ints (an optimiser's per-parameter state)
STATE_FILE = "state.json"
TENSORS_FILE = "tensors.safetensors"


def warmup_cosine_lr(step: int, total: int, warmup: int, base: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine down to 10% of ``base`` at ``total``."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


# ------------------------------------------------------------------------------------------- checkpoints
def split_state(obj: Any, tensors: dict[str, torch.Tensor], path: str = "t") -> Any:
    """``obj`` with every tensor moved into ``tensors`` (under a fresh name) and replaced by a reference; tuples
    become lists; a dict with int keys is marked so the keys come back as ints."""
    if isinstance(obj, torch.Tensor):
        name = f"{path}.{len(tensors)}"
        tensors[name] = obj.detach().to("cpu").contiguous().clone()
        return {TENSOR_REF: name}
    if isinstance(obj, dict):
        if obj and all(isinstance(k, int) for k in obj):
            return {INT_KEYS: [[k, split_state(v, tensors, path)] for k, v in obj.items()]}
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"checkpoint dicts need str or int keys, got {sorted(map(type, obj), key=str)}")
        return {k: split_state(v, tensors, path) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [split_state(v, tensors, path) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"a checkpoint holds tensors, numbers, strings, lists and dicts; got {type(obj).__name__}")


def join_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`split_state`."""
    if isinstance(obj, dict):
        if set(obj) == {TENSOR_REF}:
            return tensors[obj[TENSOR_REF]]
        if set(obj) == {INT_KEYS}:
            return {int(k): join_state(v, tensors) for k, v in obj[INT_KEYS]}
        return {k: join_state(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_state(v, tensors) for v in obj]
    return obj


def save_checkpoint(folder: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``folder`` (tensors + JSON, each written to a temporary file and moved into place, the
    JSON last: a checkpoint whose JSON is present is complete)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    doc = split_state(state, tensors)
    tmp = folder / (TENSORS_FILE + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, folder / TENSORS_FILE)
    tmp = folder / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, folder / STATE_FILE)


def has_checkpoint(folder: Path) -> bool:
    return (folder / STATE_FILE).is_file()


def load_checkpoint(folder: Path, restart_flag: str) -> dict[str, Any]:
    """The state :func:`save_checkpoint` wrote; a missing, damaged or foreign piece is a ValueError that names
    ``restart_flag`` (the command's option to start over)."""
    try:
        doc = json.loads((folder / STATE_FILE).read_text())
        tensors = load_file(str(folder / TENSORS_FILE))
        state = join_state(doc, tensors)
    except Exception as e:  # a missing file, bad JSON, a dangling tensor reference, safetensors' own errors
        raise ValueError(f"the checkpoint in {folder} is unreadable ({type(e).__name__}: {e}); pass {restart_flag} "
                         "to start over") from None
    if not isinstance(state, dict):
        raise ValueError(f"the checkpoint in {folder} is not a training state; pass {restart_flag} to start over")
    return state


__all__ = [
    "has_checkpoint",
    "join_state",
    "load_checkpoint",
    "save_checkpoint",
    "split_state",
    "warmup_cosine_lr",
    "write_record",
]

"""What every drafter trainer's loop shares: the learning-rate schedule, checkpoints, and the run's record.

Checkpoints hold no pickled Python: a run's state (weights, optimiser moments, history, schedules, settings) is
split into its tensors, saved with safetensors, and everything else, saved as JSON, where each tensor is replaced
by a reference to it. Loading joins them back, so resuming needs no ``torch.load`` at all, and a damaged or
foreign file is a clear error that says how to start over instead of a traceback deep in unpickling.
"""

from __future__ import annotations

import json
import math
import sysconfig
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from leapdecode.atomic_files import file_digest, save_tensors_atomic, write_json_atomic
from leapdecode.eval.prompts import shared_data_dir
from leapdecode.speculative.artifacts import write_record

TENSOR_REF = "__tensor__"
INT_KEYS = "__int_keys__"  # a dict whose keys were ints (an optimiser's per-parameter state)
STATE_FILE = "state.json"
TENSORS_FILE = "tensors.safetensors"  # the tensors of checkpoints written before they named their file
CHECKPOINT_KEY = "__checkpoint__"  # in the JSON: which tensors file it pairs with, and its digest


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
    """Write ``state`` to ``folder``: the tensors to a file of a new name, then the JSON that names it (with its
    digest), each atomically (atomic_files.py), then the previous tensors file is removed. The JSON is the
    manifest, written last: a crash at any point leaves the previous checkpoint or the new one, whole."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    doc = split_state(state, tensors)
    name = f"tensors-{uuid.uuid4().hex[:12]}.safetensors"
    save_tensors_atomic(folder / name, tensors)
    write_json_atomic(folder / STATE_FILE, {CHECKPOINT_KEY: {"tensors": name, **file_digest(folder / name)},
                                            "state": doc}, indent=None)
    for old in [*folder.glob("tensors-*.safetensors"), folder / TENSORS_FILE]:
        if old.name != name:
            old.unlink(missing_ok=True)


def has_checkpoint(folder: Path) -> bool:
    return (folder / STATE_FILE).is_file()


def load_checkpoint(folder: Path, restart_flag: str) -> dict[str, Any]:
    """The state :func:`save_checkpoint` wrote; a missing, damaged or foreign piece is a ValueError that names
    ``restart_flag`` (the command's option to start over)."""
    try:
        doc = json.loads((folder / STATE_FILE).read_text())
        meta = doc.pop(CHECKPOINT_KEY, None) if isinstance(doc, dict) else None
        if meta is None:  # written before checkpoints named their tensors file
            tensors = load_file(str(folder / TENSORS_FILE))
        else:
            path = folder / meta["tensors"]
            if file_digest(path) != {"bytes": meta["bytes"], "sha256": meta["sha256"]}:
                raise ValueError(f"{path.name} does not match the digest {STATE_FILE} holds")
            tensors = load_file(str(path))
            doc = doc["state"]
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


def portable_path(path: str | Path) -> str:
    """A path as an artifact's files record it: under site-packages or the shared data folder it is written
    ``<site-packages>/...`` or ``<shared data>/...``, so a committed artifact names no machine's folders."""
    text = str(path)
    roots = ((sysconfig.get_paths()["purelib"], "<site-packages>"), (str(shared_data_dir()), "<shared data>"))
    for root, name in roots:
        root = root.rstrip("/") + "/"
        if text.startswith(root):
            return name + "/" + text[len(root):]
    return text

"""Distillation data for every drafter trainer, and the one way they run the target over it.

``leapdecode train distill-data`` writes ``samples.jsonl`` (one prompt + the target's answer per line, token ids)
and ``manifest.json`` (how it was made). Trainers read it here: as raw samples (Medusa's heads train on answer
positions) or as :class:`Record` (the exit adapter trainers train on every position from the last prompt token
on). Held-out splits go by prompt id, so a prompt's greedy and sampled answers never straddle the split.

:class:`TargetPasses` is the one hidden-state pass: whole sequences, many per forward, through the engine's own
paged attention and kernels (so the cached states are the ones the drafter will read at inference), on a KV pool
of its own or the engine's, each batch's blocks freed before the next. :class:`HiddenCache` is the one on-disk
cache of what it computes, resumable and keyed by the data and settings (Medusa keeps final-norm features at
answer positions there; the adapters h_L at every position and the teacher's top-k logits).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ForwardItem, ModelRunner
from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.speculative.shadow_cache import Shadow

SAMPLES_FILE = "samples.jsonl"
MANIFEST_FILE = "manifest.json"
PASS_BLOCK = 16  # block size of a pool made for training passes
CACHE_META = "meta.json"


# ---------------------------------------------------------------------------------------------- samples
def data_file_of(path: str | Path) -> Path:
    """``samples.jsonl`` in a distill-data folder, or the file itself."""
    p = Path(path)
    f = p / SAMPLES_FILE if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"no {SAMPLES_FILE} at {path}; create it with `leapdecode train distill-data`")
    return f


def _iter_samples(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path} line {i + 1} is not JSON ({e}); rewrite it with `leapdecode train "
                                 "distill-data`") from None
            if not isinstance(r, dict) or "prompt_token_ids" not in r or "output_token_ids" not in r:
                raise ValueError(f"{path} line {i + 1} lacks prompt_token_ids / output_token_ids")
            yield i, r


def read_samples(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The samples that have an answer (at most ``limit``)."""
    out: list[dict[str, Any]] = []
    for _, r in _iter_samples(path):
        if r["output_token_ids"]:
            out.append(r)
        if limit and len(out) >= limit:
            break
    return out


def read_manifest(data_file: Path) -> dict[str, Any] | None:
    """How the data was made (``manifest.json`` beside ``samples.jsonl``), for the artifact's record."""
    path = data_file.parent / MANIFEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Record:
    """One prompt + answer. Training positions are P-1 .. T-1 (each predicts the next answer token, the last
    one the token after the answer), so a record has T - P + 1 of them."""

    rid: str
    tokens: list[int]
    prompt_len: int

    @property
    def num_answer(self) -> int:
        return len(self.tokens) - self.prompt_len + 1


def load_records(path: Path, max_seq_len: int, limit: int | None) -> list[Record]:
    """Records truncated to ``max_seq_len`` tokens; a record whose prompt alone fills that is skipped."""
    out: list[Record] = []
    for i, r in _iter_samples(path):
        prompt, answer = list(r["prompt_token_ids"]), list(r["output_token_ids"])
        if not prompt or len(prompt) >= max_seq_len:
            continue
        out.append(Record(f"{r.get('id', i)}", (prompt + answer)[:max_seq_len], len(prompt)))
        if limit and len(out) >= limit:
            break
    return out


def split_records(records: list[Record], val_fraction: float, seed: int) -> tuple[list[Record], list[Record]]:
    """Held-out by prompt id (greedy and sampled answers of one prompt stay on one side)."""
    ids = sorted({r.rid for r in records})
    random.Random(seed).shuffle(ids)
    n_val = max(1, round(len(ids) * val_fraction)) if len(ids) > 1 else 0
    val_ids = set(ids[:n_val])
    return [r for r in records if r.rid not in val_ids], [r for r in records if r.rid in val_ids]


def batches_by_tokens(lengths: Sequence[int], budget: int, max_seqs: int = 64) -> list[list[int]]:
    """Consecutive index groups of at most ``budget`` tokens and ``max_seqs`` sequences (a longer one alone)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and (used + n > budget or len(cur) >= max_seqs):
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


# ------------------------------------------------------------------------------------- record batches
@dataclass
class Split:
    """Records of one split with their slices into the cached tensors."""

    records: list[Record]
    h_off: list[int]  # start row of each record in ``hidden``
    a_off: list[int]  # start row of each record in the teacher tensors


def make_split(records: list[Record], all_records: list[Record]) -> Split:
    index = {id(r): k for k, r in enumerate(all_records)}
    h_off, a_off, h, a = [], [], 0, 0
    starts: list[tuple[int, int]] = []
    for r in all_records:
        starts.append((h, a))
        h += len(r.tokens)
        a += r.num_answer
    for r in records:
        hs, as_ = starts[index[id(r)]]
        h_off.append(hs)
        a_off.append(as_)
    return Split(records, h_off, a_off)


def plan_batches(split: Split, batch_tokens: int, seed: int | None) -> list[list[int]]:
    """Record indices per step, padded size (records x longest) within ``batch_tokens``; ``seed`` shuffles
    (records of similar length are grouped within windows of 64 to keep padding low), None keeps order."""
    order = list(range(len(split.records)))
    if seed is not None:
        random.Random(seed).shuffle(order)
        windows = [sorted(order[i : i + 64], key=lambda k: len(split.records[k].tokens))
                   for i in range(0, len(order), 64)]
        order = [k for w in windows for k in w]
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for k in order:
        n = len(split.records[k].tokens)
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(k)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    if seed is not None:
        random.Random(seed + 1).shuffle(batches)
    return batches


@dataclass
class Batch:
    """Right-padded records: cached hidden states ``x`` [B, T, H], token ids [B, T], the real-token mask and the
    answer-row mask [B, T], and the teacher's top-k rows for the answer rows in row-major order."""

    x: torch.Tensor
    tokens: torch.Tensor
    real: torch.Tensor
    mask: torch.Tensor
    t_val: torch.Tensor
    t_idx: torch.Tensor


def gather_batch(split: Split, idx: list[int], cache: dict[str, Any], device: torch.device,
                 dtype: torch.dtype) -> Batch:
    recs = [split.records[k] for k in idx]
    t = max(len(r.tokens) for r in recs)
    hid = cache["hidden"]
    x = hid.new_zeros(len(recs), t, hid.shape[1])
    tokens = torch.zeros(len(recs), t, dtype=torch.long)
    real = torch.zeros(len(recs), t, dtype=torch.bool)
    mask = torch.zeros(len(recs), t, dtype=torch.bool)
    vals, ids = [], []
    for b, (k, r) in enumerate(zip(idx, recs)):
        n = len(r.tokens)
        x[b, :n] = hid[split.h_off[k] : split.h_off[k] + n]
        tokens[b, :n] = torch.tensor(r.tokens, dtype=torch.long)
        real[b, :n] = True
        mask[b, r.prompt_len - 1 : n] = True
        vals.append(cache["t_val"][split.a_off[k] : split.a_off[k] + r.num_answer])
        ids.append(cache["t_idx"][split.a_off[k] : split.a_off[k] + r.num_answer])
    return Batch(x.to(device, dtype), tokens.to(device), real.to(device), mask.to(device),
                 torch.cat(vals).to(device, torch.float32), torch.cat(ids).to(device, torch.long))


# ------------------------------------------------------------------------------------------ hidden cache
@dataclass(frozen=True)
class CachedArray:
    """One array of a :class:`HiddenCache`: ``rows[i]`` rows of ``width`` values for sequence i."""

    rows: list[int]
    width: int
    dtype: str  # a numpy dtype name: "float16", "int32"


class HiddenCache:
    """Target-pass results over a list of sequences on disk, the one cache every trainer keeps them in: one
    ``.npy`` per array (sequence i's rows at ``starts[i]:starts[i + 1]``) and ``meta.json`` with the key it was
    built for and how many sequences are done. Filled batch by batch (:func:`fill_caches`), so an interrupted
    build resumes; a different key (other data, model or settings) starts it afresh."""

    def __init__(self, folder: Path, key: dict[str, Any], arrays: dict[str, CachedArray]) -> None:
        self.folder, self.key, self.arrays = Path(folder), key, arrays
        self.starts = {n: np.concatenate([[0], np.cumsum(a.rows)]).astype(np.int64) for n, a in arrays.items()}
        meta = None
        if (self.folder / CACHE_META).is_file():
            try:
                meta = json.loads((self.folder / CACHE_META).read_text())
            except ValueError:
                meta = None  # a damaged meta file: rebuild
        self.fresh = meta is None or meta.get("key") != key or not all((self.folder / f"{n}.npy").is_file()
                                                                        for n in arrays)
        self.meta = {"key": key, "done": 0, "complete": False, "seconds": 0.0} if self.fresh else meta
        self._maps: dict[str, np.ndarray] = {}

    @property
    def complete(self) -> bool:
        return bool(self.meta["complete"])

    @property
    def done(self) -> int:
        return int(self.meta["done"])

    def open(self) -> None:
        """Memory-map the arrays for writing (created when fresh)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, a in self.arrays.items():
            path = self.folder / f"{name}.npy"
            shape = (int(self.starts[name][-1]), a.width)
            self._maps[name] = np.lib.format.open_memmap(path, mode="w+", dtype=a.dtype, shape=shape) \
                if self.fresh else np.lib.format.open_memmap(path, mode="r+")
        self._write_meta()

    def write(self, name: str, seq: int, rows: torch.Tensor) -> None:
        st = self.starts[name]
        self._maps[name][st[seq] : st[seq + 1]] = rows.numpy().astype(self.arrays[name].dtype)

    def advance(self, done: int, seconds: float, complete: bool = False) -> None:
        for m in self._maps.values():
            m.flush()
        self.meta.update(done=done, complete=complete, seconds=round(self.meta["seconds"] + seconds, 1))
        self._write_meta()

    def load(self, name: str, in_memory: bool = True) -> np.ndarray:
        arr = np.load(self.folder / f"{name}.npy", mmap_mode="r")
        return np.array(arr) if in_memory else arr  # a copy in memory: random batches read RAM, not disk pages

    def _write_meta(self) -> None:
        (self.folder / CACHE_META).write_text(json.dumps(self.meta))


def fill_caches(caches: list[HiddenCache], groups: list[list[int]],
                compute: Callable[[list[int]], dict[str, list[torch.Tensor]]], desc: str) -> None:
    """Fill the incomplete ``caches`` group by group: ``compute(seqs)`` returns, per array name, one tensor of
    rows per sequence (the arrays of every cache it fills); each cache resumes after its own last done sequence."""
    todo = [c for c in caches if not c.complete]
    if not todo:
        return
    for c in todo:
        c.open()
    start = min(c.done for c in todo)
    bar = tqdm(total=sum(len(g) for g in groups), initial=sum(len(g) for g in groups if g[-1] < start), desc=desc,
               unit="seq")
    t0 = time.time()
    for g in groups:
        g = [i for i in g if i >= start]
        if not g:
            continue
        out = compute(g)
        for c in todo:
            for name in c.arrays:
                for i, rows in zip(g, out[name]):
                    if i >= c.done:
                        c.write(name, i, rows)
        for c in todo:
            c.advance(max(c.done, g[-1] + 1), time.time() - t0)
        t0 = time.time()
        bar.update(len(g))
    bar.close()
    for c in todo:
        c.advance(c.done, 0.0, complete=True)


# --------------------------------------------------------------------------------------- target passes
class TargetPasses:
    """Batched target forwards over whole sequences for training caches (module docstring)."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, bm: BlockManager, runner: ModelRunner) -> None:
        self.model, self.kv, self.bm, self.runner = model, kv, bm, runner

    @classmethod
    def own_pool(cls, model: LlamaForCausalLM, batch_tokens: int, lengths: Sequence[int]) -> TargetPasses:
        """A pool of its own, large enough for ``batch_tokens`` of sequences of these ``lengths`` (the longest
        alone, and each sequence's last block partly empty)."""
        p = next(model.parameters())
        cap = max(batch_tokens, max(lengths))
        blocks = cap // PASS_BLOCK + cap // max(1, min(lengths)) + 2
        kv = KVCache(model.config, blocks, PASS_BLOCK, p.dtype, p.device)
        bm = BlockManager(blocks, PASS_BLOCK, enable_prefix_caching=False)
        return cls(model, kv, bm, ModelRunner(model, kv, PASS_BLOCK, p.device))

    @classmethod
    def of_engine(cls, engine: Any) -> TargetPasses:
        """The engine's own pool and runner (its blocks are borrowed per batch and returned)."""
        return cls(engine.model, engine.kv_cache, engine.block_manager, engine.runner)

    @torch.inference_mode()
    def run(self, seqs: list[list[int]], layer: int, final_norm: bool, logit_rows: list[range] | None = None,
            topk: int = 0) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The residual stream after the first ``layer`` target layers at every position of every sequence
        ([sum T, H], sequences in order; ``final_norm``: the target's final norm applied), and with
        ``logit_rows`` (positions per sequence) the target's top-``topk`` logits there (values, ids)."""
        shadows = [Shadow() for _ in seqs]
        try:
            for sh, toks in zip(shadows, seqs):
                if not self.bm.can_allocate(sh, len(toks)):  # type: ignore[arg-type]
                    raise RuntimeError("a training pass does not fit the KV pool; lower its batch tokens")
                self.bm.allocate(sh, len(toks))  # type: ignore[arg-type]
            rows = logit_rows or [range(0) for _ in seqs]
            items = [ForwardItem(sh.block_table, 0, toks, list(r)) for sh, toks, r in zip(shadows, seqs, rows)]
            ids, pos, meta, out_rows = self.runner.prepare(items)
            h = self.model(ids, pos, self.kv.layers, meta, layers=range(layer), final_norm=final_norm)
            teacher = None
            if logit_rows is not None:
                n = self.model.config.num_hidden_layers
                out = self.model(ids, pos, self.kv.layers, meta, layers=range(layer, n), hidden=h)
                teacher = self.model.compute_logits(out.index_select(0, out_rows)).float().topk(topk, dim=-1)
        finally:
            for sh in shadows:
                self.bm.free(sh)  # type: ignore[arg-type]
        return h, (None if teacher is None else (teacher.values, teacher.indices))

    def answer_features(self, samples: Sequence[dict[str, Any]], max_len: int) -> list[torch.Tensor]:
        """Final-norm hidden states at each answer position (the position whose logits predict answer token t),
        one batched pass for all ``samples``: [len(answer), d] per sample, float32 on the CPU. A prompt longer
        than ``max_len`` - 1 keeps its tail (the answer positions must survive)."""
        seqs, spans = [], []
        for s in samples:
            p, o = list(s["prompt_token_ids"]), list(s["output_token_ids"])
            toks = p + o[:-1]  # the last answer token's own hidden state predicts nothing trained on
            if len(toks) > max_len - 1:
                cut = len(toks) - (max_len - 1)
                toks, p = toks[cut:], p[cut:]
            seqs.append(toks)
            spans.append((len(p) - 1, len(p) - 1 + len(o)))
        hidden, _ = self.run(seqs, self.model.config.num_hidden_layers, True)
        out, q = [], 0
        for toks, (a, b) in zip(seqs, spans):
            out.append(hidden[q + a : q + b].float().cpu())
            q += len(toks)
        return out


__all__ = [
    "Batch",
    "CachedArray",
    "HiddenCache",
    "fill_caches",
    "Record",
    "Split",
    "gather_batch",
    "make_split",
    "plan_batches",
    "TargetPasses",
    "batches_by_tokens",
    "data_file_of",
    "file_sha256",
    "load_records",
    "read_manifest",
    "read_samples",
    "split_records",
]

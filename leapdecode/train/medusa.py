"""``leapdecode train medusa``: train Medusa heads on the target's own answers (self-distillation).

Pipeline (each stage resumable):

1. **Data** — ``leapdecode train distill-data --out DIR`` stores the target's answers (samples.jsonl).
2. **Hidden cache** — one batched prefill of prompt + answer through the target, keeping the final-norm hidden
   state at every answer position (fp16, ``DATA/hidden_cache/``, shared by every run on that data). Done once, so
   training never runs the 135M-parameter body again: a head step is the residual block plus the LM-head matmul.
3. **Training** — head i on offset k learns the teacher's token k places after the one the target predicts from
   the same hidden state. For greedy answers that token *is* the teacher's argmax at that position; sampled
   answers give draws from the teacher's distribution (an unbiased estimate of the soft target). ``--targets
   soft`` instead distils the teacher's full distribution at that position (its logits are one LM-head pass over
   the cached hidden state k rows later). Loss ``sum_k w_k * CE_k`` with ``w`` decaying with offset (default 1.0,
   0.8, 0.6, 0.4), the student's softmax temperature rising with offset (default 1.0, 1.2, 1.4, 1.6: flatter
   targets where the future is less certain, so far heads keep several candidates alive for the tree).

   - *Progressive*: only offset 1 trains at first; offset k+1 is added once offset k's loss is stable (relative
     improvement between consecutive windows below ``--stable-tol``) or after ``--stage-max-frac`` of the run.
     Each head has its own parameters and optimiser state, so a late head starts with fresh Adam moments.
   - *Curriculum*: batches are drawn from answer positions whose context length is at most ``L(t)``, growing
     linearly from ``--curriculum-start`` to the longest context over the first ``--curriculum-frac`` of the run.
   - *Compute*: the 49k-wide LM head dominates the cost, so by default the heads train (and later run) on the
     ``--vocab-subset`` most frequent answer tokens (8192 cover ~98% of them; the coverage is printed, and
     validation counts out-of-subset targets as misses, so the accuracy cost is measured, not assumed; ``0`` =
     full vocabulary). Matmuls run in bfloat16 autocast (``--precision``; AMX makes that ~3-5x faster than
     float32 on this CPU). ``--grad-checkpoint`` recomputes each head's logits in backward instead of keeping
     [batch, vocab] activations per head (needed for the full vocabulary at large batches).
4. **Validation** each epoch on held-out prompts (split by prompt id, so greedy and sampled answers to one prompt
   never straddle it): per-head top-1/top-k accuracy, per-offset merged candidate accuracy, and the rank paths of
   the true continuations, from which the shipped tree is built (tree.py).
5. **Export** to ``--out``: heads (fp16), config.json (layout, tree, metrics, fingerprint of the LM head they were
   trained on) and record.json (exact command, data manifest, seed, timings), the one artifact format
   (speculative/artifacts.py).

``leapdecode train medusa-tree`` re-derives the tree from the development prompts (plain greedy decoding, then the
heads' ranks of what followed) and picks the default tree size with this machine's measured step cost.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
import zlib
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from leapdecode.llm import LLM
from leapdecode.models.loader import model_display_name
from leapdecode.speculative import tree as T
from leapdecode.speculative.artifacts import lm_head_fingerprint, save_heads
from leapdecode.speculative.heads import MedusaHeads, masked_argmax_chain, parse_layout, ranked_candidates
from leapdecode.speculative.methods.medusa import DEFAULT_TOP_K
from leapdecode.train.data import (
    CachedArray,
    HiddenCache,
    TargetPasses,
    batches_by_tokens,
    file_sha256,
    fill_caches,
    read_manifest,
    read_samples,
)
from leapdecode.train.loop import has_checkpoint, load_checkpoint, portable_path, save_checkpoint, warmup_cosine_lr
from leapdecode.train.medusa_loss import TrainableHeads, head_losses, weighted_loss
from leapdecode.train.medusa_schedules import CurriculumSampler, CurriculumSchedule, ProgressiveSchedule
from leapdecode.train.medusa_tree import default_tree_nodes

DEFAULT_WEIGHTS = (1.0, 0.8, 0.6, 0.4)
DEFAULT_TEMPERATURES = (1.0, 1.2, 1.4, 1.6)


# ------------------------------------------------------------------------------------------------- config
@dataclass
class MedusaTrainConfig:
    """Every knob of a run; stored in checkpoints and in the artifact's record."""

    data: str
    out: str
    work_dir: str | None = None  # checkpoints; default <data>/medusa_work
    cache_dir: str | None = None  # hidden states, shared by runs on the same data; default <data>/hidden_cache
    model: str | None = None
    dtype: str = "float32"  # the target's dtype when caching hidden states (inference runs it in float32)
    layout: str = "pyramid"
    diversity: str = "exclude"
    targets: str = "hard"  # hard: the teacher's own tokens; soft: the teacher's distribution
    loss_weights: tuple[float, ...] = DEFAULT_WEIGHTS
    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES
    vocab_subset: int = 8192  # 0 = full vocabulary
    batch_size: int = 512
    epochs: float = 3.0
    max_steps: int | None = None
    time_budget_min: float | None = None  # caps the number of steps from a measured step time
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_frac: float = 0.03
    init_std: float = 0.02
    progressive: bool = True
    stage_min_frac: float = 0.02
    stage_max_frac: float = 0.1
    stable_tol: float = 0.01
    stable_window: int = 20
    curriculum: bool = True
    curriculum_start: int = 64
    curriculum_frac: float = 0.5
    grad_checkpoint: bool = False
    precision: str = "bf16"  # bf16 autocast for the matmuls, or fp32
    val_frac: float = 0.05
    val_max_tokens: int = 8192
    report_topk: int = 5
    tree_topk: int = DEFAULT_TOP_K
    tree_max_nodes: int = 64
    save_every: int = 200
    cache_batch_tokens: int = 2048
    cache_precision: str = "fp32"  # bf16: autocast the caching forward (faster on AMX CPUs, ~0.6% hidden error)
    seed: int = 0
    restart: bool = False
    limit_samples: int | None = None

    def __post_init__(self) -> None:
        self.loss_weights = tuple(float(x) for x in self.loss_weights)
        self.temperatures = tuple(float(x) for x in self.temperatures)
        if self.targets not in ("hard", "soft"):
            raise ValueError(f"targets must be hard or soft, got {self.targets!r}")
        if self.precision not in ("bf16", "fp32") or self.cache_precision not in ("bf16", "fp32"):
            raise ValueError(f"precision must be bf16 or fp32, got {self.precision!r}")
        if not self.loss_weights or min(self.loss_weights) < 0:
            raise ValueError("loss weights must be a non-empty list of non-negative numbers")
        if not self.temperatures or min(self.temperatures) <= 0:
            raise ValueError("temperatures must be positive")
        parse_layout(self.layout)

    @property
    def work(self) -> Path:
        return Path(self.work_dir) if self.work_dir else Path(self.data) / "medusa_work"

    @property
    def cache(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else Path(self.data) / "hidden_cache"


def per_offset(values: Seq[float], max_offset: int, extend: str) -> list[float]:
    """Value for offsets 1..max_offset from a list indexed by offset; a short list is extended (``"decay"``:
    x0.8 per extra offset, ``"grow"``: +last step)."""
    vals = [float(v) for v in values][:max_offset]
    while len(vals) < max_offset:
        if extend == "decay":
            vals.append(vals[-1] * 0.8)
        else:
            step = vals[-1] - vals[-2] if len(vals) > 1 else 0.0
            vals.append(vals[-1] + step)
    return vals


# ------------------------------------------------------------------------------------------ hidden cache
def build_hidden_cache(cfg: MedusaTrainConfig, llm: LLM, samples_path: Path, log=print) -> Path:
    """Write (or finish) the cache folder (data.HiddenCache): hidden.npy [N, d] fp16, the final-norm features at
    every answer position, and beside it tokens.npy / positions.npy int32 [N], starts.npy int64 [S + 1], ids.json.
    Resumable batch by batch; rebuilt if the data changed."""
    samples = read_samples(samples_path, cfg.limit_samples)
    if not samples:
        raise ValueError(f"{samples_path} has no samples with answers")
    key = {"samples": file_sha256(samples_path)[:16], "limit": cfg.limit_samples,
           "model": str(llm.engine.model_path), "dtype": cfg.dtype, "precision": cfg.cache_precision}
    lengths = [len(s["output_token_ids"]) for s in samples]
    d = llm.engine.model_config.hidden_size
    cache = HiddenCache(cfg.cache, key, {"hidden": CachedArray(lengths, d, "float16")})
    if cache.complete:
        return cfg.cache
    if cache.fresh:
        cfg.cache.mkdir(parents=True, exist_ok=True)
        np.save(cfg.cache / "tokens.npy", np.concatenate([np.asarray(s["output_token_ids"], dtype=np.int32)
                                                          for s in samples]))
        np.save(cfg.cache / "positions.npy", np.concatenate([
            np.arange(len(s["prompt_token_ids"]) - 1, len(s["prompt_token_ids"]) - 1 + len(s["output_token_ids"]))
            for s in samples]).astype(np.int32))
        np.save(cfg.cache / "starts.npy", cache.starts["hidden"])
        (cfg.cache / "ids.json").write_text(json.dumps([str(s.get("id", i)) for i, s in enumerate(samples)]))
    passes = TargetPasses.of_engine(llm.engine)

    def compute(seqs: list[int]) -> dict[str, list[torch.Tensor]]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.cache_precision == "bf16"):
            return {"hidden": passes.answer_features([samples[i] for i in seqs], llm.engine.max_model_len)}

    seq_lens = [len(s["prompt_token_ids"]) + len(s["output_token_ids"]) - 1 for s in samples]
    fill_caches([cache], batches_by_tokens(seq_lens, cfg.cache_batch_tokens), compute, "hidden cache")
    log(f"hidden cache: {sum(lengths)} answer positions from {len(samples)} samples in {cache.meta['seconds']:.0f} s "
        f"-> {cfg.cache}")
    return cfg.cache


@dataclass
class TokenData:
    """Cached rows with their targets: ``targets[r, k-1]`` is the answer token k places after the one row r's
    own LM head predicts (-1 past the end of the answer)."""

    hidden: np.ndarray  # [N, d] float16
    tokens: np.ndarray  # [N] the teacher's own next token at each row
    positions: np.ndarray  # [N] context length
    targets: np.ndarray  # [N, D] int64
    train_rows: np.ndarray
    val_rows: np.ndarray

    @classmethod
    def load(cls, cache: Path, max_offset: int, val_frac: float) -> TokenData:
        hidden = np.load(cache / "hidden.npy", mmap_mode="r")
        if hidden.nbytes < (4 << 30):  # random batches from RAM, not from disk pages
            hidden = np.ascontiguousarray(hidden)
        tokens = np.load(cache / "tokens.npy").astype(np.int64)
        positions = np.load(cache / "positions.npy")
        starts = np.load(cache / "starts.npy")
        ids = json.loads((cache / "ids.json").read_text())
        n = len(tokens)
        lengths = np.diff(starts)
        end = np.repeat(starts[1:], lengths)
        r = np.arange(n)
        targets = np.full((n, max_offset), -1, dtype=np.int64)
        for k in range(1, max_offset + 1):
            ok = r + k < end
            targets[ok, k - 1] = tokens[(r + k)[ok]]
        is_val = np.array([zlib.crc32(i.encode()) % 10000 < val_frac * 10000 for i in ids], dtype=bool)
        row_val = np.repeat(is_val, lengths)
        return cls(hidden, tokens, positions, targets, np.nonzero(~row_val)[0], np.nonzero(row_val)[0])


def choose_subset(tokens: np.ndarray, size: int, vocab: int) -> torch.Tensor | None:
    """The ``size`` most frequent tokens (ties: lower id), sorted by id; None for the full vocabulary."""
    if size <= 0 or size >= vocab:
        return None
    counts = np.bincount(tokens, minlength=vocab)
    order = np.lexsort((np.arange(vocab), -counts))[:size]
    return torch.from_numpy(np.sort(order)).long()


# ---------------------------------------------------------------------------------------------- trainer
class MedusaTrainer:
    """Owns the data, the heads, the optimiser and the schedules of one run (see the module docstring)."""

    def __init__(self, cfg: MedusaTrainConfig, llm=None, log=print) -> None:
        self.cfg, self.log = cfg, log
        torch.manual_seed(cfg.seed)
        samples_path = Path(cfg.data) / "samples.jsonl"
        if not samples_path.is_file():
            raise FileNotFoundError(f"{samples_path} not found; create it with `leapdecode train distill-data`")
        self.samples_path = samples_path
        cfg.work.mkdir(parents=True, exist_ok=True)
        if llm is None:
            longest = max(len(r["prompt_token_ids"]) + len(r["output_token_ids"])
                          for r in read_samples(samples_path, cfg.limit_samples))
            blocks = -(-max(cfg.cache_batch_tokens, longest) // 16) + 72  # + per-sample rounding (<= 64 seqs)
            llm = LLM(model=cfg.model, dtype=cfg.dtype, kv_cache_blocks=blocks)
        self.llm = llm
        eng = self.llm.engine
        t0 = time.time()
        cache = build_hidden_cache(cfg, self.llm, samples_path, log)
        self.cache_seconds = json.loads((cache / "meta.json").read_text()).get("seconds", time.time() - t0)
        self.offsets = parse_layout(cfg.layout)
        self.max_offset = max(self.offsets)
        self.data = TokenData.load(cache, self.max_offset, cfg.val_frac)
        if len(self.data.train_rows) == 0:
            raise ValueError("no training rows (all samples fell in the validation split); add data")
        vocab = eng.model_config.vocab_size
        self.vocab = vocab
        self.full_w = eng.model.lm_head.get_weight().detach()
        self.subset = choose_subset(self.data.tokens[self.data.train_rows], cfg.vocab_subset, vocab)
        self.remap = torch.full((vocab,), -1, dtype=torch.long)
        if self.subset is None:
            self.remap = torch.arange(vocab)
            self.lm_w = self.full_w.float()
        else:
            self.remap[self.subset] = torch.arange(len(self.subset))
            self.lm_w = self.full_w.index_select(0, self.subset).float().contiguous()
        self.weights = per_offset(cfg.loss_weights, self.max_offset, "decay")
        self.temps = per_offset(cfg.temperatures, self.max_offset, "grow")
        base = MedusaHeads(eng.model_config.hidden_size, self.offsets, cfg.diversity)
        base.init_weights(cfg.seed, cfg.init_std)
        self.heads = TrainableHeads(base)
        self.opt = torch.optim.AdamW(
            [{"params": [self.heads.w[i], self.heads.b[i]]} for i in range(len(self.offsets))],
            lr=cfg.lr, weight_decay=cfg.weight_decay,
        )
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.steps_per_epoch = max(1, math.ceil(len(self.data.train_rows) / cfg.batch_size))
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.val_history: list[dict[str, Any]] = []
        self.train_seconds = 0.0
        pos = self.data.positions[self.data.train_rows]
        self.curriculum = CurriculumSchedule(int(pos.max()), cfg.curriculum, cfg.curriculum_start,
                                             cfg.curriculum_frac)
        self.sampler = CurriculumSampler(pos, cfg.batch_size, self.gen)
        self.progressive = self._new_progressive()
        self.ckpt_path = cfg.work / "checkpoint"
        if has_checkpoint(self.ckpt_path) and not cfg.restart:
            self.load_checkpoint()
        elif cfg.time_budget_min:
            self.fit_time_budget()

    def _new_progressive(self) -> ProgressiveSchedule:
        c, n = self.cfg, self.total_steps
        return ProgressiveSchedule(self.max_offset, c.progressive, max(1, int(c.stage_min_frac * n)),
                                   max(1, int(c.stage_max_frac * n)), c.stable_tol, c.stable_window)

    # ------------------------------------------------------------------------------------------ pieces
    def batch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.from_numpy(np.asarray(self.data.hidden[np.sort(rows)], dtype=np.float32))
        tg = torch.from_numpy(self.data.targets[np.sort(rows)])
        sub = torch.where(tg >= 0, self.remap[tg.clamp_min(0)], -1)
        return h, sub

    def teacher_logits(self, rows: np.ndarray, offsets: Seq[int]) -> dict[int, torch.Tensor]:
        """Teacher logits (subset columns) for the token k places ahead: the LM head on row r + k's hidden."""
        rows = np.sort(rows)
        n = len(self.data.tokens)
        out = {}
        with torch.no_grad():
            for k in offsets:
                hk = torch.from_numpy(np.asarray(self.data.hidden[np.minimum(rows + k, n - 1)], dtype=np.float32))
                out[k] = F.linear(hk, self.lm_w)
        return out

    def autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16")

    def lr_at(self, step: int) -> float:
        return warmup_cosine_lr(step, self.total_steps, max(1, int(self.cfg.warmup_frac * self.total_steps)),
                                self.cfg.lr)

    def train_step(self, rows: np.ndarray, offsets: Seq[int]) -> dict[int, float]:
        """One optimiser step on ``rows`` for the heads of ``offsets``; returns the per-head losses."""
        h, tg = self.batch(rows)
        teacher = self.teacher_logits(rows, offsets) if self.cfg.targets == "soft" else None
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        self.opt.zero_grad(set_to_none=True)
        with self.autocast():
            losses = head_losses(self.heads, self.lm_w, h, tg, offsets, self.temps, teacher, self.cfg.grad_checkpoint)
        total = weighted_loss(losses, self.heads.offsets, self.weights)
        total.backward()
        self.opt.step()
        return {i: float(v.detach()) for i, v in losses.items()}

    def fit_time_budget(self) -> None:
        """Cap the number of steps so the training loop fits ``time_budget_min``, from the measured time of a
        full step (all heads; early progressive stages are faster, so this errs on the short side)."""
        rows = self.sampler.sample(self.curriculum.end_len)
        saved = [p.detach().clone() for p in self.heads.parameters()]
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            self.train_step(rows, list(range(1, self.max_offset + 1)))
            ts.append(time.perf_counter() - t0)
        with torch.no_grad():  # undo the probe steps: the run starts from the initial weights
            for p, s in zip(self.heads.parameters(), saved):
                p.copy_(s)
        self.opt = torch.optim.AdamW(
            [{"params": [self.heads.w[i], self.heads.b[i]]} for i in range(len(self.offsets))],
            lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
        )
        per = sorted(ts)[1]
        cap = max(1, int(self.cfg.time_budget_min * 60 / per))
        if cap < self.total_steps:
            self.log(f"time budget {self.cfg.time_budget_min} min at {per:.2f} s/step: {cap} steps "
                     f"(of {self.total_steps} for {self.cfg.epochs} epochs)")
            self.total_steps = cap
            self.progressive = self._new_progressive()

    # -------------------------------------------------------------------------------------- validation
    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """Per-head top-1 / top-k accuracy, per-offset merged candidate accuracy, and tree statistics on the
        held-out rows (targets outside the vocabulary subset count as misses)."""
        rows = self.data.val_rows
        if len(rows) == 0:
            rows = self.data.train_rows  # tiny data sets: report on training rows rather than nothing
        if len(rows) > self.cfg.val_max_tokens:
            rows = rows[np.linspace(0, len(rows) - 1, self.cfg.val_max_tokens).astype(np.int64)]
        heads = self.heads.export()
        nh, kk, topk = heads.num_heads, self.cfg.report_topk, max(self.cfg.tree_topk, 1)
        hit1 = torch.zeros(nh)
        hitk = torch.zeros(nh)
        denom = torch.zeros(self.max_offset)
        merged_hits = torch.zeros(self.max_offset, topk)
        all_ranks = []
        for i in range(0, len(rows), 1024):
            r = rows[i : i + 1024]
            h = torch.from_numpy(np.asarray(self.data.hidden[r], dtype=np.float32))
            tg_full = torch.from_numpy(self.data.targets[r])
            exists = tg_full >= 0
            tg = torch.where(exists, self.remap[tg_full.clamp_min(0)], -1)
            with self.autocast():
                logits = F.linear(heads(h), self.lm_w).float()  # [B, H, V']
            denom += exists.sum(dim=0).float()
            for k in range(1, self.max_offset + 1):
                g = heads.groups[k]
                lg = logits[:, g]
                if heads.diversity == "exclude":
                    picks = masked_argmax_chain(lg)
                    for j, hd in enumerate(g):
                        lj = lg[:, j].scatter(1, picks[:, :j], float("-inf")) if j else lg[:, j]
                        t = tg[:, k - 1]
                        hit1[hd] += ((picks[:, j] == t) & (t >= 0)).sum()
                        hitk[hd] += ((lj.topk(kk, dim=-1).indices == t.unsqueeze(1)).any(1) & (t >= 0)).sum()
                else:
                    for j, hd in enumerate(g):
                        t = tg[:, k - 1]
                        hit1[hd] += ((lg[:, j].argmax(-1) == t) & (t >= 0)).sum()
                        hitk[hd] += ((lg[:, j].topk(kk, dim=-1).indices == t.unsqueeze(1)).any(1) & (t >= 0)).sum()
            cand = ranked_candidates(logits, heads, topk)  # [B, D, K]
            match = (cand == tg.unsqueeze(2)) & (tg >= 0).unsqueeze(2)
            merged_hits += match.sum(dim=0).float()
            ranks = torch.where(match.any(dim=2), match.float().argmax(dim=2), -1)
            all_ranks.append(ranks)
        ranks = torch.cat(all_ranks)
        counts = T.rank_path_counts(ranks)
        paths = T.top_paths(counts, self.cfg.tree_max_nodes)
        curve = T.expected_tokens_curve(paths, counts, len(rows))
        d_of = [denom[o - 1].clamp_min(1) for o in heads.offsets]
        res = {
            "step": self.step,
            "rows": int(len(rows)),
            "head_top1": [round(float(hit1[i] / d_of[i]), 4) for i in range(nh)],
            f"head_top{kk}": [round(float(hitk[i] / d_of[i]), 4) for i in range(nh)],
            "offset_merged_topk": [[round(float(x), 4) for x in (merged_hits[k].cumsum(0) / denom[k].clamp_min(1))]
                                   for k in range(self.max_offset)],
            "tree": {"paths": [list(p) for p in paths], "counts": [counts[p] for p in paths],
                     "num_steps": int(len(rows)), "curve": [round(c, 4) for c in curve], "topk": topk},
        }
        return res

    def print_validation(self, v: dict[str, Any], epoch: float) -> None:
        kk = self.cfg.report_topk
        lines = [f"validation after epoch {epoch:.2f} (step {v['step']}, {v['rows']} held-out positions):",
                 f"  {'head':>4} {'offset':>6} {'rank':>4} {'top1':>7} {'top' + str(kk):>7}"]
        groups = self.heads.groups
        for i, o in enumerate(self.heads.offsets):
            lines.append(f"  {i:>4} {o:>6} {groups[o].index(i):>4} {v['head_top1'][i]:>7.3f} "
                         f"{v[f'head_top{kk}'][i]:>7.3f}")
        for k, acc in enumerate(v["offset_merged_topk"], start=1):
            shown = ", ".join(f"top{j + 1} {acc[j]:.3f}" for j in (0, 2, len(acc) - 1) if j < len(acc))
            lines.append(f"  offset +{k} merged candidates: {shown}")
        curve = v["tree"]["curve"]
        lines.append("  expected tokens/step by tree size: " + ", ".join(
            f"{n} nodes {curve[n]:.2f}" for n in (1, 4, 8, 16, 32, 64) if n < len(curve)))
        self.log("\n".join(lines))

    # ---------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        state = {
            "config": asdict(self.cfg), "step": self.step, "total_steps": self.total_steps,
            "heads": self.heads.state_dict(), "opt": self.opt.state_dict(), "gen": self.gen.get_state(),
            "progressive": self.progressive.state_dict(), "history": self.history, "val_history": self.val_history,
            "subset": self.subset, "train_seconds": self.train_seconds,
        }
        save_checkpoint(self.ckpt_path, state)

    def load_checkpoint(self) -> None:
        st = load_checkpoint(self.ckpt_path, "--restart")
        old = st["config"]
        for k in ("layout", "diversity", "vocab_subset", "targets", "batch_size"):
            if old.get(k) != getattr(self.cfg, k):
                raise ValueError(f"checkpoint {self.ckpt_path} was made with {k}={old.get(k)!r}, this run has "
                                 f"{getattr(self.cfg, k)!r}; pass --restart to start over")
        self.heads.load_state_dict(st["heads"])
        self.opt.load_state_dict(st["opt"])
        self.gen.set_state(st["gen"])
        self.step, self.total_steps = st["step"], st["total_steps"]
        self.progressive = self._new_progressive()
        self.progressive.load_state_dict(st["progressive"])
        self.history, self.val_history = st["history"], st["val_history"]
        self.train_seconds = st.get("train_seconds", 0.0)
        self.log(f"resumed from {self.ckpt_path} at step {self.step}/{self.total_steps}")

    # ---------------------------------------------------------------------------------------------- run
    def train(self, max_new_steps: int | None = None) -> dict[str, Any]:
        """Run (or continue) to ``total_steps``; ``max_new_steps`` stops early (as an interruption would)."""
        cfg = self.cfg
        stop_at = self.total_steps if max_new_steps is None else min(self.total_steps, self.step + max_new_steps)
        cov = float(np.isin(self.data.tokens[self.data.val_rows if len(self.data.val_rows) else
                                             self.data.train_rows],
                            self.subset.numpy()).mean()) if self.subset is not None else 1.0
        self.log(f"medusa: {len(self.offsets)} heads on offsets {self.offsets} ({cfg.diversity}), "
                 f"{len(self.data.train_rows)} train / {len(self.data.val_rows)} val positions, vocab "
                 f"{'full' if self.subset is None else len(self.subset)} (held-out coverage {cov:.3f}), "
                 f"{self.total_steps} steps of {cfg.batch_size} ({self.steps_per_epoch} per epoch)")
        self.coverage = cov
        bar = tqdm(total=self.total_steps, initial=self.step, desc="medusa", unit="step")
        t0 = time.time()
        while self.step < stop_at:
            progress = self.step / self.total_steps
            offsets = self.progressive.active_offsets()
            max_len = self.curriculum.max_len(progress)
            rows = self.sampler.sample(max_len)
            losses = self.train_step(rows, offsets)
            newest = self.progressive.offset
            newest_loss = sum(losses[i] for i in self.heads.groups[newest]) / len(self.heads.groups[newest])
            if self.progressive.update(self.step, newest_loss):
                self.log(f"step {self.step + 1}: offset +{self.progressive.offset} heads join")
            self.history.append({"step": self.step, "offsets": len(offsets), "max_len": max_len,
                                 "loss": {int(k): round(v, 4) for k, v in losses.items()}})
            self.step += 1
            per_off = {k: sum(losses[i] for i in self.heads.groups[k]) / len(self.heads.groups[k]) for k in offsets}
            bar.set_postfix_str(" ".join(f"+{k}:{v:.2f}" for k, v in per_off.items()) + f" len<={max_len}")
            bar.update(1)
            end_epoch = self.step % self.steps_per_epoch == 0 or self.step == self.total_steps
            if self.step % cfg.save_every == 0 or end_epoch:
                self.train_seconds += time.time() - t0
                t0 = time.time()
                if end_epoch:
                    v = self.validate()
                    self.val_history.append(v)
                    self.print_validation(v, self.step / self.steps_per_epoch)
                self.save_checkpoint()
        bar.close()
        self.train_seconds += time.time() - t0
        if self.step < self.total_steps:
            self.save_checkpoint()
            return self.val_history[-1] if self.val_history else {}
        if not self.val_history or self.val_history[-1]["step"] != self.step:
            v = self.validate()
            self.val_history.append(v)
            self.print_validation(v, self.step / self.steps_per_epoch)
        return self.val_history[-1]

    def export(self, out: str | Path, command: str) -> Path:
        """Write the artifact folder (heads, config with tree and metrics, record)."""
        v = self.val_history[-1]
        eng = self.llm.engine
        tree = dict(v["tree"])
        tree["default_nodes"] = default_tree_nodes(eng, tree["curve"])
        manifest = read_manifest(self.samples_path)
        meta = {
            "vocab_size": self.vocab,
            "vocab_subset_size": 0 if self.subset is None else len(self.subset),
            "vocab_subset_coverage": round(getattr(self, "coverage", 1.0), 4),
            "base_model": {"name": model_display_name(Path(eng.model_path)), "path": portable_path(eng.model_path),
                           "lm_head_fingerprint": lm_head_fingerprint(self.full_w)},
            "tree": tree,
            "validation": {k: v[k] for k in v if k != "tree"},
            "train": {"steps": self.step, "batch_size": self.cfg.batch_size,
                      "train_positions": int(len(self.data.train_rows)), "transitions": self.progressive.transitions,
                      "loss_weights": self.weights, "temperatures": self.temps},
        }
        record = {
            "command": command,
            "config": asdict(self.cfg),
            "seed": self.cfg.seed,
            "data": {"samples": str(self.samples_path), "sha256_16": file_sha256(self.samples_path)[:16],
                     "manifest": manifest},
            "seconds": {"hidden_cache": self.cache_seconds, "training": round(self.train_seconds, 1)},
            "torch": torch.__version__,
        }
        save_heads(out, self.heads.export(), self.subset, meta, record)
        return Path(out)


def parse_floats(s: str) -> tuple[float, ...]:
    """``"1,0.8,0.6"`` -> (1.0, 0.8, 0.6): per-offset values on the command line."""
    return tuple(float(x) for x in s.split(",") if x.strip())


def cmd_medusa(args: argparse.Namespace) -> int:
    names = {f.name for f in fields(MedusaTrainConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names and v is not None}
    cfg = MedusaTrainConfig(**kw)
    command = "leapdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    trainer = MedusaTrainer(cfg)
    trainer.train()
    out = trainer.export(cfg.out, command)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"wrote Medusa heads to {out} ({size:.1f} MB); use them with "
          f"speculative_config={{'method': 'medusa', 'model': '{out}'}}")
    return 0


__all__ = ["MedusaTrainConfig", "MedusaTrainer", "TokenData", "choose_subset", "cmd_medusa", "parse_floats",
           "per_offset"]

"""``leapdecode train blockwise``: train blockwise decoding's block heads (speculative/block_heads.py) on the
target's own answers, every block of a stretch in parallel under the block-causal mask.

Pipeline (each stage resumable):

1. **Data**: ``leapdecode train distill-data`` (the target's answers) and the hidden-state cache of the Medusa
   trainer (train/medusa.py: the target's final-norm hidden state at every answer position, computed once).
2. **Stretches**: a training example is ``num_blocks`` consecutive blocks of ``k`` answer tokens, the stretch
   ending at a random answer position. Block b's query is the cached hidden state that emitted its last token;
   its keys are the target's input embeddings of the stretch's tokens (prompt tokens where the stretch starts
   before the answer); its targets are the k answer tokens after it. A block that ends inside the prompt has no
   hidden state and trains nothing; a slot past the end of the answer has no target.
3. **Loss**: ``sum_j w_j * CE_j`` over the k slots of every block (``w`` decays with the slot, as a chain is only
   as long as its first miss). **Gradient checkpointing per block** (on by default, ``--no-grad-checkpoint``):
   each block's attention, heads and read-out logits are recomputed in backward instead of kept, so activation
   memory holds one block's logits, not ``num_blocks`` of them (tests/test_block_heads.py measures it).
4. **Validation** on held-out prompts (split by prompt id): every held-out answer position as a block end, in
   the decoding form (the newest block of a stretch), giving each slot's top-1 accuracy and the chain's
   acceptance curve: P(the first i proposals all equal the target's tokens), whose sum + 1 is the expected mean
   block size, the prior blockwise decoding sizes its blocks with.
5. **Export** to ``--out``: heads (fp16), config.json (settings, validation, fingerprint of the LM head) and
   record.json (command, configuration with ``grad_checkpoint``, data manifest, seed, timings).

``--stop-after-min`` ends this invocation after N minutes at a checkpoint (rerun the command to continue), so a
long run fits in pieces.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from leapdecode.llm import LLM
from leapdecode.models.loader import model_display_name
from leapdecode.speculative.artifacts import lm_head_fingerprint, load_block_heads, save_block_heads
from leapdecode.speculative.block_heads import BlockHeads
from leapdecode.train.data import file_sha256, read_manifest, read_samples
from leapdecode.train.loop import has_checkpoint, load_checkpoint, portable_path, save_checkpoint, warmup_cosine_lr
from leapdecode.train.medusa import MedusaTrainConfig, TokenData, build_hidden_cache, choose_subset, per_offset

DEFAULT_WEIGHTS = (1.0, 0.8, 0.6, 0.4)


@dataclass
class BlockwiseTrainConfig:
    """Every knob of a run; stored in checkpoints and in the artifact's record."""

    data: str
    out: str
    work_dir: str | None = None  # checkpoints; default <data>/blockwise_work
    cache_dir: str | None = None  # the Medusa trainer's hidden cache; default <data>/hidden_cache
    model: str | None = None
    dtype: str = "float32"
    num_heads: int = 8  # k: proposals per block
    num_blocks: int = 4  # blocks per training stretch = the context the heads read (num_blocks * k tokens)
    attn_heads: int = 4
    head_dim: int = 64
    loss_weights: tuple[float, ...] = DEFAULT_WEIGHTS
    vocab_subset: int = 8192
    batch_size: int = 64  # stretches per step (num_blocks * k proposals each)
    epochs: float = 4.0  # over the training answer positions, each a stretch end
    max_steps: int | None = None
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_frac: float = 0.03
    init_std: float = 0.02
    grad_checkpoint: bool = True  # per block (module docstring, step 3)
    precision: str = "bf16"
    val_frac: float = 0.05
    val_max_rows: int = 4096
    save_every: int = 100
    stop_after_min: float | None = None  # this invocation only: stop at a checkpoint after N minutes
    cache_batch_tokens: int = 2048
    cache_precision: str = "fp32"
    seed: int = 0
    restart: bool = False
    limit_samples: int | None = None

    def __post_init__(self) -> None:
        self.loss_weights = tuple(float(x) for x in self.loss_weights)
        if self.precision not in ("bf16", "fp32") or self.cache_precision not in ("bf16", "fp32"):
            raise ValueError(f"precision must be bf16 or fp32, got {self.precision!r} / {self.cache_precision!r}")
        if not self.loss_weights or min(self.loss_weights) < 0:
            raise ValueError("loss weights must be a non-empty list of non-negative numbers")
        for name in ("num_heads", "num_blocks", "attn_heads", "head_dim", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def work(self) -> Path:
        return Path(self.work_dir) if self.work_dir else Path(self.data) / "blockwise_work"

    def cache_config(self) -> MedusaTrainConfig:
        """The hidden cache's settings, as the Medusa trainer names them (the two share one cache)."""
        return MedusaTrainConfig(data=self.data, out=self.out, cache_dir=self.cache_dir, model=self.model,
                                 dtype=self.dtype, cache_batch_tokens=self.cache_batch_tokens,
                                 cache_precision=self.cache_precision, limit_samples=self.limit_samples)


# --------------------------------------------------------------------------------------------- stretches
@dataclass
class Stretches:
    """The cached rows with what a stretch needs: each row's place in its sample's full token sequence."""

    data: TokenData
    full_tokens: np.ndarray  # prompt + answer of every sample, concatenated
    row_full: np.ndarray  # [N] index in full_tokens of the answer token row r emitted
    row_first: np.ndarray  # [N] the first row of row r's sample
    sample_start: np.ndarray  # [N] index in full_tokens where row r's sample starts

    @classmethod
    def load(cls, cache: Path, samples: list[dict[str, Any]], k: int, val_frac: float) -> Stretches:
        data = TokenData.load(cache, k, val_frac)
        starts = np.load(cache / "starts.npy")
        lengths = np.diff(starts)
        full = [np.asarray(s["prompt_token_ids"] + s["output_token_ids"], dtype=np.int64) for s in samples]
        if len(full) != len(lengths) or any(len(s["output_token_ids"]) != n for s, n in zip(samples, lengths)):
            raise ValueError(f"the hidden cache in {cache} does not match the samples; rebuild it (delete it)")
        offs = np.concatenate([[0], np.cumsum([len(f) for f in full])[:-1]]).astype(np.int64)
        sample_of_row = np.repeat(np.arange(len(lengths)), lengths)
        answer_at = np.repeat(offs + np.array([len(s["prompt_token_ids"]) for s in samples]), lengths)
        local = np.arange(len(data.tokens)) - np.repeat(starts[:-1], lengths)
        return cls(data, np.concatenate(full), answer_at + local, np.repeat(starts[:-1], lengths),
                   offs[sample_of_row])

    def batch(self, ends: np.ndarray, k: int, nb: int) -> dict[str, torch.Tensor]:
        """Stretches ending at rows ``ends``: ``h`` [S, nb, d], ``ids`` / ``valid`` [S, L], ``targets``
        [S, nb, k] (-1: none) and ``qvalid`` [S, nb] (the block ends inside the answer)."""
        L = nb * k
        block_rows = ends[:, None] - k * np.arange(nb - 1, -1, -1)[None, :]  # [S, nb]
        qvalid = block_rows >= self.row_first[ends][:, None]
        rows = np.where(qvalid, block_rows, ends[:, None])
        full_idx = self.row_full[ends][:, None] - np.arange(L - 1, -1, -1)[None, :]  # [S, L], oldest first
        valid = full_idx >= self.sample_start[ends][:, None]
        ids = self.full_tokens[np.where(valid, full_idx, 0)]
        h = np.asarray(self.data.hidden[rows.reshape(-1)], dtype=np.float32).reshape(len(ends), nb, -1)
        tg = np.where(qvalid[:, :, None], self.data.targets[rows.reshape(-1)].reshape(len(ends), nb, k), -1)
        return {"h": torch.from_numpy(h), "ids": torch.from_numpy(ids), "valid": torch.from_numpy(valid),
                "targets": torch.from_numpy(tg), "qvalid": torch.from_numpy(qvalid)}


# -------------------------------------------------------------------------------------------------- loss
def block_loss(heads: BlockHeads, lm_w: torch.Tensor, h: torch.Tensor, emb: torch.Tensor, valid: torch.Tensor,
               targets: torch.Tensor, weights: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ``b``'s weighted loss (a sum over its valid slots) and per-slot sums of cross-entropy [k]."""
    z = heads.forward_blocks(h, emb, valid, [b])[:, 0]  # [S, k, d]
    logits = F.linear(z, lm_w).float()
    tg = targets[:, b]
    ce = F.cross_entropy(logits.flatten(0, 1), tg.flatten(), ignore_index=-1, reduction="none").view_as(tg)
    per_slot = ce.sum(dim=0)
    return (per_slot * weights).sum(), per_slot.detach()


def stretch_losses(heads: BlockHeads, lm_w: torch.Tensor, batch: dict[str, torch.Tensor], emb: torch.Tensor,
                   weights: torch.Tensor, per_block_checkpoint: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's loss (weighted, mean over valid proposals) and per-slot mean cross-entropy [k]. With
    ``per_block_checkpoint`` each block's forward runs under ``torch.utils.checkpoint``: recomputed in backward,
    so only one block's activations are alive at a time. Same loss and gradients either way."""
    h, valid, tg = batch["h"], batch["valid"], batch["targets"]
    total = torch.zeros(())
    slot_sums = torch.zeros(heads.k)
    for b in range(heads.num_blocks):
        if per_block_checkpoint:
            loss, per_slot = checkpoint(block_loss, heads, lm_w, h, emb, valid, tg, weights, b, use_reentrant=False)
        else:
            loss, per_slot = block_loss(heads, lm_w, h, emb, valid, tg, weights, b)
        total = total + loss
        slot_sums += per_slot
    counts = (tg >= 0).sum(dim=(0, 1)).clamp_min(1)
    return total / counts.sum(), slot_sums / counts


# ------------------------------------------------------------------------------------------------ trainer
class BlockwiseTrainer:
    """Data, heads, optimiser and schedule of one run (module docstring)."""

    def __init__(self, cfg: BlockwiseTrainConfig, llm: LLM | None = None,
                 log: Callable[[str], None] = print) -> None:
        self.cfg, self.log = cfg, log
        torch.manual_seed(cfg.seed)
        self.samples_path = Path(cfg.data) / "samples.jsonl"
        if not self.samples_path.is_file():
            raise FileNotFoundError(f"{self.samples_path} not found; create it with `leapdecode train distill-data`")
        samples = read_samples(self.samples_path, cfg.limit_samples)
        if llm is None:
            longest = max(len(r["prompt_token_ids"]) + len(r["output_token_ids"]) for r in samples)
            blocks = -(-max(cfg.cache_batch_tokens, longest) // 16) + 72
            llm = LLM(model=cfg.model, dtype=cfg.dtype, kv_cache_blocks=blocks)
        self.llm = llm
        model = llm.engine.model
        t0 = time.time()
        cache = build_hidden_cache(cfg.cache_config(), llm, self.samples_path, log)
        meta = json.loads((cache / "meta.json").read_text())  # what building it took, over every piece
        self.cache_seconds = round(float(meta.get("seconds", time.time() - t0)), 1)
        self.data = Stretches.load(cache, samples, cfg.num_heads, cfg.val_frac)
        if len(self.data.data.train_rows) == 0:
            raise ValueError("no training rows (all samples fell in the validation split); add data")
        self.embed = model.embed
        self.vocab = llm.engine.model_config.vocab_size
        self.full_w = model.lm_head.get_weight().detach()
        self.subset = choose_subset(self.data.data.tokens[self.data.data.train_rows], cfg.vocab_subset, self.vocab)
        self.remap = torch.arange(self.vocab)
        if self.subset is not None:  # full vocabulary id -> subset column (-1: outside the subset, a miss)
            self.remap = torch.full((self.vocab,), -1, dtype=torch.long)
            self.remap[self.subset] = torch.arange(len(self.subset))
        self.lm_w = (self.full_w if self.subset is None else self.full_w.index_select(0, self.subset)).float()
        self.weights = torch.tensor(per_offset(cfg.loss_weights, cfg.num_heads, "decay"))
        self.heads = BlockHeads(model.config.hidden_size, cfg.num_heads, cfg.num_blocks, cfg.attn_heads, cfg.head_dim)
        self.heads.init_weights(cfg.seed, cfg.init_std)
        self.opt = torch.optim.AdamW(self.heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.gen = np.random.default_rng(cfg.seed)
        steps_per_epoch = max(1, math.ceil(len(self.data.data.train_rows) / cfg.batch_size))
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
        self.step, self.train_seconds = 0, 0.0
        self.history: list[dict[str, Any]] = []
        self.val_history: list[dict[str, Any]] = []
        self.ckpt_path = cfg.work / "checkpoint"
        if has_checkpoint(self.ckpt_path) and not cfg.restart:
            self.load_checkpoint()

    def embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.embed(ids).float()

    def subset_targets(self, tg: torch.Tensor) -> torch.Tensor:
        return torch.where(tg >= 0, self.remap[tg.clamp_min(0)], -1)

    def train_step(self, ends: np.ndarray) -> dict[str, Any]:
        batch = self.data.batch(ends, self.cfg.num_heads, self.cfg.num_blocks)
        batch["targets"] = self.subset_targets(batch["targets"])
        emb = self.embeddings(batch["ids"])
        for g in self.opt.param_groups:
            g["lr"] = warmup_cosine_lr(self.step, self.total_steps,
                                       max(1, int(self.cfg.warmup_frac * self.total_steps)), self.cfg.lr)
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"):
            loss, per_slot = stretch_losses(self.heads, self.lm_w, batch, emb, self.weights, self.cfg.grad_checkpoint)
        loss.backward()
        self.opt.step()
        return {"step": self.step, "loss": round(float(loss.detach()), 4),
                "slots": [round(float(x), 3) for x in per_slot]}

    # ------------------------------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """Per-slot top-1 accuracy and the chain acceptance curve on held-out block ends (decoding form)."""
        rows = self.data.data.val_rows if len(self.data.data.val_rows) else self.data.data.train_rows
        if len(rows) > self.cfg.val_max_rows:
            rows = rows[np.linspace(0, len(rows) - 1, self.cfg.val_max_rows).astype(np.int64)]
        k, nb = self.cfg.num_heads, self.cfg.num_blocks
        hits = torch.zeros(k)
        denom = torch.zeros(k)
        chain = torch.zeros(k)
        for i in range(0, len(rows), 512):
            batch = self.data.batch(rows[i: i + 512], k, nb)
            tg = self.subset_targets(batch["targets"][:, -1])  # [B, k]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"):
                z = self.heads(batch["h"][:, -1], self.embeddings(batch["ids"]), batch["valid"])
                pick = F.linear(z, self.lm_w).float().argmax(dim=-1)
            exists = batch["targets"][:, -1] >= 0
            ok = (pick == tg) & (tg >= 0)
            hits += ok.sum(dim=0).float()
            denom += exists.sum(dim=0).float()
            chain += ok.long().cumprod(dim=1).sum(dim=0).float()  # first i all right (misses past the end)
        curve = [round(float(x), 4) for x in chain / len(rows)]
        return {"step": self.step, "rows": int(len(rows)),
                "head_top1": [round(float(x), 4) for x in hits / denom.clamp_min(1)],
                "chain_acceptance": curve, "expected_block": round(1.0 + sum(curve), 4)}

    # ----------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        save_checkpoint(self.ckpt_path, {
            "config": asdict(self.cfg), "step": self.step, "total_steps": self.total_steps,
            "heads": self.heads.state_dict(), "opt": self.opt.state_dict(),
            "rng": self.gen.bit_generator.state, "history": self.history, "val_history": self.val_history,
            "train_seconds": self.train_seconds})

    def load_checkpoint(self) -> None:
        st = load_checkpoint(self.ckpt_path, "--restart")
        for key in ("num_heads", "num_blocks", "attn_heads", "head_dim", "vocab_subset", "batch_size"):
            if st["config"].get(key) != getattr(self.cfg, key):
                raise ValueError(f"checkpoint {self.ckpt_path} was made with {key}={st['config'].get(key)!r}, this "
                                 f"run has {getattr(self.cfg, key)!r}; pass --restart to start over")
        self.heads.load_state_dict(st["heads"])
        self.opt.load_state_dict(st["opt"])
        self.gen.bit_generator.state = st["rng"]
        self.step, self.total_steps = st["step"], st["total_steps"]
        self.history, self.val_history = st["history"], st["val_history"]
        self.train_seconds = st["train_seconds"]
        self.log(f"resumed from {self.ckpt_path} at step {self.step}/{self.total_steps}")

    # ------------------------------------------------------------------------------------------------ run
    def train(self) -> bool:
        """Run (or continue) toward ``total_steps``; False when ``stop_after_min`` stopped it first (the state
        is checkpointed: rerun to continue)."""
        cfg = self.cfg
        if self.step == 0:
            self.val_history.append(self.validate())
            self.log(f"blockwise: {cfg.num_heads} heads, {cfg.num_blocks} blocks per stretch, "
                     f"{len(self.data.data.train_rows)} train / {len(self.data.data.val_rows)} val positions, "
                     f"{self.total_steps} steps of {cfg.batch_size} stretches; untrained: {self.val_history[-1]}")
        start = time.time()
        t0 = start
        train_rows = self.data.data.train_rows
        while self.step < self.total_steps:
            rec = self.train_step(self.gen.choice(train_rows, cfg.batch_size))
            self.step += 1
            if self.step % 10 == 0:
                self.history.append(rec)
            if self.step % cfg.save_every == 0 or self.step == self.total_steps:
                self.train_seconds += time.time() - t0
                t0 = time.time()
                self.val_history.append(self.validate())
                self.log(f"step {self.step}/{self.total_steps} loss {rec['loss']:.3f}: {self.val_history[-1]}")
                self.save_checkpoint()
                if cfg.stop_after_min and time.time() - start > cfg.stop_after_min * 60 and \
                        self.step < self.total_steps:
                    self.log(f"stopped after {cfg.stop_after_min} min at step {self.step}; rerun to continue")
                    return False
        self.train_seconds += time.time() - t0
        return True

    def export(self, out: str | Path, command: str) -> Path:
        """Write the artifact folder (heads, config with validation, record with the training settings)."""
        eng = self.llm.engine
        v = self.val_history[-1]
        meta = {
            "vocab_size": self.vocab,
            "vocab_subset_size": 0 if self.subset is None else len(self.subset),
            "base_model": {"name": model_display_name(Path(eng.model_path)), "path": portable_path(eng.model_path),
                           "lm_head_fingerprint": lm_head_fingerprint(self.full_w)},
            "validation": v,
            "validation_untrained": self.val_history[0],
            "train": {"steps": self.step, "batch_size": self.cfg.batch_size, "block_mask": "block-causal",
                      "grad_checkpoint": "per block" if self.cfg.grad_checkpoint else "off",
                      "train_positions": int(len(self.data.data.train_rows)),
                      "loss_weights": [round(float(x), 4) for x in self.weights]},
        }
        record = {
            "command": command, "config": asdict(self.cfg), "seed": self.cfg.seed,
            "data": {"samples": str(self.samples_path), "sha256_16": file_sha256(self.samples_path)[:16],
                     "manifest": read_manifest(self.samples_path)},
            "seconds": {"hidden_cache": self.cache_seconds, "training": round(self.train_seconds, 1)},
            "history": self.history[-50:], "torch": torch.__version__,
        }
        save_block_heads(out, self.heads, self.subset, meta, record)
        load_block_heads(out)  # what was written reads back
        return Path(out)


def cmd_blockwise(args: argparse.Namespace) -> int:
    names = {f.name for f in fields(BlockwiseTrainConfig)}
    cfg = BlockwiseTrainConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None})
    command = "leapdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    trainer = BlockwiseTrainer(cfg)
    if not trainer.train():
        return 0
    out = trainer.export(cfg.out, command)
    print(f"wrote blockwise heads to {out}; use them with speculative_config={{'method': 'blockwise', "
          f"'model': '{out}'}}")
    return 0


__all__ = ["BlockwiseTrainConfig", "BlockwiseTrainer", "Stretches", "block_loss", "cmd_blockwise",
           "stretch_losses"]

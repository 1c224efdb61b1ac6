"""``leapdecode train self-spec`` / ``draft-model`` / ``eagle``: train an exit adapter (speculative/exit_adapter.py).

One trainer serves three drafters: self_spec's exit (``--layer L``), the small draft (``train draft-model``: L = 0)
and EAGLE's feature draft (``train eagle``: the draft trainer with feature inputs).

The drafter is ``LMHead(norm(adapter(h_L)))`` (speculative/methods/self_spec.py). Training makes its
next-token distribution match the target's on the target's own answers (``leapdecode train distill-data``):

1. **Cache once.** One pass of the target over every record (data.TargetPasses) stores ``h_L`` (the residual
   stream after layer L, every position, float16) and the teacher's top-k logits at the answer positions; the
   teacher cache does not depend on L, so trying another L only reruns layers [0, L). Caches are keyed by the
   data's hash and the settings, so a rerun reuses them.
2. **Train** the adapter alone (the target, its LM head included, stays frozen) with a soft cross-entropy to the
   teacher's top-k distribution, optionally mixed with hard cross-entropy to its argmax. The 49k-row LM head
   dominates the cost of a small model's training step, so by default the loss scores only a frequency-ranked
   vocabulary subset (``--vocab-subset``, measured from the training answers); validation reports agreement with
   both the full head and the subset head, so what the subset costs is measured, not guessed.
3. **Validate** every epoch on held-out prompts: top-1 agreement with the target (what a greedy draft token's
   acceptance rate is), coverage and agreement above the drafting threshold, and the loss. Epoch 0 is the
   untrained initialisation, i.e. the early-exit baseline.
4. **Checkpoint** every ``--save-every`` steps and each epoch (loop.py; rerun the same command to resume), and
   write the artifact: ``adapter.safetensors`` (best validation epoch), ``config.json``, ``record.json`` (exact command,
   data manifest and hash, seed, history, timings). ``speculative_config={"method": "self_spec", "model": OUT}``
   loads it; copy it to ``leapdecode/artifacts/self_spec/`` to ship it as the default.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from leapdecode.config import DTYPES, EngineConfig
from leapdecode.engine.llm_engine import LLMEngine
from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.models.loader import load_model, resolve_model
from leapdecode.speculative.artifacts import save_adapter, target_fingerprint, write_record
from leapdecode.speculative.exit_adapter import ExitAdapter
from leapdecode.speculative.methods.eagle import EagleProposer
from leapdecode.speculative.methods.self_spec import SelfSpecProposer
from leapdecode.speculative.policy import StepCostModel, expected_tokens, scratch_step
from leapdecode.train.data import (
    Batch,
    CachedArray,
    HiddenCache,
    Record,
    Split,
    TargetPasses,
    batches_by_tokens,
    data_file_of,
    file_sha256,
    fill_caches,
    gather_batch,
    load_records,
    make_split,
    plan_batches,
    read_manifest,
    split_records,
)
from leapdecode.train.loop import has_checkpoint, load_checkpoint, save_checkpoint, warmup_cosine_lr


# ---------------------------------------------------------------------------------------------------- cache
def adapter_caches(cache_dir: Path, records: list[Record], base_key: dict[str, Any], layer: int, width: int,
                   topk: int) -> tuple[HiddenCache, HiddenCache]:
    """The teacher's top-k logits at the answer positions (independent of L, so one teacher cache serves every
    run on the data) and h_L at every position (per L)."""
    answers = [r.num_answer for r in records]
    teacher = HiddenCache(cache_dir / "teacher", {**base_key, "topk": topk},
                          {"t_val": CachedArray(answers, topk, "float16"),
                           "t_idx": CachedArray(answers, topk, "int32")})
    hidden = HiddenCache(cache_dir / f"hidden_L{layer}", {**base_key, "layer": layer},
                         {"hidden": CachedArray([len(r.tokens) for r in records], width, "float16")})
    return teacher, hidden


def fill_adapter_caches(model: LlamaForCausalLM, records: list[Record], layer: int, topk: int, batch_tokens: int,
                        teacher: HiddenCache, hidden: HiddenCache) -> None:
    """One pass of the target over ``records`` (data.TargetPasses) fills whichever caches are incomplete: h_L
    always comes out of it, the teacher's logits only when that cache needs them (they cost every layer)."""
    if teacher.complete and hidden.complete:
        return
    passes = TargetPasses.own_pool(model, batch_tokens, [len(r.tokens) for r in records])
    with_teacher = not teacher.complete

    def compute(seqs: list[int]) -> dict[str, list[torch.Tensor]]:
        batch = [records[i] for i in seqs]
        rows = [range(r.prompt_len - 1, len(r.tokens)) for r in batch] if with_teacher else None
        h, top = passes.run([r.tokens for r in batch], layer, False, rows, topk)
        out = {"hidden": list(h.to("cpu", torch.float16).split([len(r.tokens) for r in batch]))}
        if top is not None:
            sizes = [r.num_answer for r in batch]
            out["t_val"] = list(top[0].to("cpu", torch.float16).split(sizes))
            out["t_idx"] = list(top[1].to("cpu", torch.int32).split(sizes))
        return out

    groups = batches_by_tokens([len(r.tokens) for r in records], batch_tokens, max_seqs=len(records))
    caches = [teacher, hidden] if with_teacher else [hidden]
    fill_caches(caches, groups, compute, "cache h_L + teacher" if with_teacher else f"cache h_L (L={layer})")


def dense_passes(adapter: ExitAdapter, model: LlamaForCausalLM, batch: Batch,
                 chain_steps: int = 1) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The adapter's outputs [B, T, H] over a batch, and for a feature draft the target features it should
    reproduce. An exit adapter or plain draft reads the cached h_L (one pass). A feature draft's first pass reads
    the target's features one position back (``batch.x`` caches h at the top layer; the target's final norm makes
    them f); each further pass (``chain_steps``) feeds the previous pass's own outputs instead, as drafting the
    2nd, 3rd... token of a chain does, so training sees the draft's own errors."""
    rope = model.rope.table(torch.arange(batch.x.shape[1], device=batch.x.device), batch.x.dtype)
    if not adapter.feature_input:
        return [adapter.forward_dense(batch.x, rope)], None
    with torch.no_grad():
        f = model.norm(batch.x)
        emb = model.embed_tokens(batch.tokens)
    outs: list[torch.Tensor] = []
    prev = f
    for _ in range(max(1, chain_steps)):
        shifted = torch.cat([prev.new_zeros(prev.shape[0], 1, prev.shape[2]), prev[:, :-1]], dim=1)
        outs.append(adapter.forward_dense(adapter.fuse(shifted, emb), rope))
        prev = outs[-1].detach()
    return outs, f


# ------------------------------------------------------------------------------------------------------ loss
class Head:
    """The frozen LM head, whole or restricted to the first ``n`` tokens of a frequency ranking."""

    def __init__(self, model: LlamaForCausalLM, ranked: torch.Tensor, n: int) -> None:
        w = model.lm_head.get_weight().detach()
        vocab = w.shape[0]
        self.full_weight = w
        if n and n < vocab:
            self.ids = ranked[:n].to(w.device)
            self.weight = w.index_select(0, self.ids)
            self.pos = torch.full((vocab,), -1, dtype=torch.long, device=w.device)
            self.pos[self.ids] = torch.arange(n, device=w.device)
        else:
            self.ids, self.weight, self.pos = None, w, None

    @property
    def size(self) -> int:
        return self.weight.shape[0]

    def map(self, t_idx: torch.Tensor) -> torch.Tensor:
        """Teacher token ids -> columns of this head (-1 = not scored)."""
        return t_idx if self.pos is None else self.pos[t_idx]


def distill_loss(hidden: torch.Tensor, head: Head, t_val: torch.Tensor, t_idx: torch.Tensor,
                 hard_weight: float, temperature: float) -> torch.Tensor:
    """Soft cross-entropy to the teacher's top-k distribution (renormalised over the tokens the head scores),
    mixed with hard cross-entropy to the teacher's argmax; rows with nothing scoreable are skipped."""
    logp = torch.log_softmax(F.linear(hidden, head.weight).float() / temperature, dim=-1)
    cols = head.map(t_idx)
    inside = cols >= 0
    p = torch.softmax(t_val / temperature, dim=-1) * inside
    mass = p.sum(-1)
    ok = mass > 0
    p = p / mass.clamp_min(1e-9).unsqueeze(-1)
    soft = -(p * logp.gather(1, cols.clamp_min(0))).sum(-1)
    loss = soft[ok].mean() if bool(ok.any()) else logp.sum() * 0.0
    if hard_weight > 0:
        top = cols[:, 0]
        hard_ok = top >= 0
        if bool(hard_ok.any()):
            hard = F.nll_loss(logp[hard_ok], top[hard_ok])
            loss = (1 - hard_weight) * loss + hard_weight * hard
    return loss


@torch.no_grad()
def evaluate(adapter: ExitAdapter, model: LlamaForCausalLM, split: Split, cache: dict[str, Any], head: Head,
             args: argparse.Namespace) -> dict[str, float]:
    """Held-out metrics: loss (training head), top-1 agreement with the target's argmax with the full LM head
    (= the drafter's greedy acceptance per position) and with the subset head, and the share of positions whose
    draft confidence reaches ``--min-draft-prob`` with the agreement there."""
    p = next(adapter.parameters())
    n = agree = agree_sub = conf_n = conf_agree = chain_agree = 0
    loss_sum = 0.0
    for idx in plan_batches(split, args.batch_tokens, None):
        b = gather_batch(split, idx, cache, p.device, p.dtype)
        t_val, t_idx = b.t_val, b.t_idx
        outs, _ = dense_passes(adapter, model, b, 2 if adapter.feature_input else 1)
        hs = outs[0][b.mask]
        rows = hs.shape[0]
        if len(outs) > 1:  # the 2nd pass drafts from the draft's own features: a chain's 2nd and later tokens
            cols = F.linear(outs[1][b.mask], head.weight).argmax(-1)
            chain_agree += int((cols if head.ids is None else head.ids[cols]).eq(t_idx[:, 0]).sum())
        loss_sum += float(distill_loss(hs, head, t_val, t_idx, args.hard_weight, args.temperature)) * rows
        teacher_top = t_idx[:, 0]
        for s in range(0, rows, 1024):  # the full head in chunks: 49k columns x many rows
            logits = F.linear(hs[s : s + 1024], head.full_weight).float()
            prob, arg = torch.softmax(logits, dim=-1).max(dim=-1)
            hit = arg == teacher_top[s : s + 1024]
            agree += int(hit.sum())
            sure = prob >= args.min_draft_prob
            conf_n += int(sure.sum())
            conf_agree += int((hit & sure).sum())
            if head.ids is not None:
                sub_arg = head.ids[F.linear(hs[s : s + 1024], head.weight).argmax(dim=-1)]
                agree_sub += int((sub_arg == teacher_top[s : s + 1024]).sum())
        n += rows
    n = max(n, 1)
    out = {"val_loss": loss_sum / n, "agree": agree / n, "confident": conf_n / n,
           "agree_confident": conf_agree / max(conf_n, 1), "positions": n}
    if adapter.feature_input:
        out["agree_own_features"] = chain_agree / n
    if head.ids is not None:
        out["agree_subset_head"] = agree_sub / n
        in_sub = head.pos[torch.cat([cache["t_idx"][split.a_off[k] : split.a_off[k] + r.num_answer, 0]
                                     for k, r in enumerate(split.records)]).long().to(head.pos.device)] >= 0
        out["teacher_top1_in_subset"] = float(in_sub.float().mean())
    return out


@torch.inference_mode()
def estimate_speed(model: LlamaForCausalLM, model_path: Path, adapter: ExitAdapter, ranked: torch.Tensor,
                   metrics: dict[str, float], subset: int, dtype: str, device: str) -> dict[str, Any]:
    """Time a target step (1..9 tokens) and a draft step (layers [0, L) + adapter + LM head, full or subset) on
    this machine, now, at batch 1, and combine them with the held-out agreement into the best chain length and
    its speedup, assuming each draft is accepted independently with that probability. A guide for choosing L
    (the draft's cost grows with L, its agreement too), not a benchmark: run ``leapdecode bench`` for that."""
    eng = LLMEngine(EngineConfig(model=str(model_path), dtype=dtype, device=device, kv_cache_blocks=16,
                                 max_num_seqs=1), model=model, tokenizer=None, model_path=model_path)
    target = StepCostModel.calibrate(lambda n: scratch_step(eng.runner, eng.block_manager, n),
                                     sizes=(1, 2, 3, 5, 9), repeats=3)
    t1 = target(1)
    out: dict[str, Any] = {"target_step_ms": round(t1 * 1e3, 2),
                           "verify_ms": {g: round(target(1 + g) * 1e3, 2) for g in (1, 2, 3, 4, 6, 8)}}
    heads = [("full", 0, metrics["agree"])]
    if subset and "agree_subset_head" in metrics:
        heads.append((f"subset{subset}", subset, metrics["agree_subset_head"]))
    for name, n, alpha in heads:
        kind = EagleProposer if adapter.feature_input else SelfSpecProposer
        prop = kind(eng.drafting_view(), adapter, 0.0, ranked[:n] if n else None)
        d1 = StepCostModel.calibrate(prop.timed_draft_step, sizes=(1,), repeats=5)(1)
        best_g, best_x = 0, 1.0
        for g in range(1, 9):
            x = expected_tokens(alpha, g) * t1 / (target(1 + g) + g * d1)
            if x > best_x:
                best_g, best_x = g, x
        out[name] = {"draft_step_ms": round(d1 * 1e3, 2), "draft_over_target": round(d1 / t1, 3),
                     "agreement": round(alpha, 4), "best_gamma": best_g, "est_speedup": round(best_x, 3)}
    eng.runner.captures.clear()
    return out



# ------------------------------------------------------------------------------------------------------ run
def check_args(args: argparse.Namespace, num_layers: int) -> None:
    if not 0 <= args.layer < num_layers:
        raise ValueError(f"--layer must be in [0, {num_layers - 1}] for this model, got {args.layer}")
    if args.features and args.layer:
        raise ValueError("feature inputs are for drafts (`leapdecode train eagle`): they share no target layers")
    if args.chain_steps < 1:
        raise ValueError(f"--chain-steps must be >= 1, got {args.chain_steps}")
    if not 1 <= args.adapter_layers <= num_layers - args.layer:
        raise ValueError(f"--adapter-layers must be in [1, {num_layers - args.layer}], got {args.adapter_layers}")


@dataclass
class Data:
    """The run's records, their cached target passes and the vocabulary ranking of the training split."""

    data_file: Path
    sha256: str
    records: list[Record]
    train: Split
    val: Split
    cache: dict[str, torch.Tensor]
    ranked: torch.Tensor
    cache_key: dict[str, Any]
    cache_seconds: float


def prepare_data(args: argparse.Namespace, model: LlamaForCausalLM, model_path: Path, out: Path) -> Data:
    """Records, the held-out split, the caches (teacher independent of L; h_L per L) and the ranking."""
    data_file = data_file_of(args.data)
    records = load_records(data_file, args.max_seq_len, args.max_records)
    if len(records) < 2:
        raise ValueError(f"{data_file} has fewer than 2 usable records")
    train_recs, val_recs = split_records(records, args.val_fraction, args.seed)
    t0 = time.time()
    sha = file_sha256(data_file)
    base_key = {"data": sha, "model": str(model_path), "dtype": args.dtype, "max_seq_len": args.max_seq_len,
                "max_records": args.max_records}
    cache_dir = Path(args.cache_dir) if args.cache_dir else out / "cache"
    # a feature draft reads the target's top-layer features, every other drafter h_L
    layer = model.config.num_hidden_layers if args.features else args.layer
    teacher, hidden = adapter_caches(cache_dir, records, base_key, layer, model.config.hidden_size, args.topk)
    fill_adapter_caches(model, records, layer, args.topk, args.cache_tokens, teacher, hidden)
    cache = {"hidden": torch.from_numpy(hidden.load("hidden")), "t_val": torch.from_numpy(teacher.load("t_val")),
             "t_idx": torch.from_numpy(teacher.load("t_idx"))}
    train, val = make_split(train_recs, records), make_split(val_recs, records)
    return Data(data_file, sha, records, train, val, cache, vocab_ranking(train, cache, model.config.vocab_size),
                teacher.key, time.time() - t0)


def vocab_ranking(train: Split, cache: dict[str, torch.Tensor], vocab: int) -> torch.Tensor:
    """Token ids by how often the training answers and the teacher's argmaxes use them (then by id)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for k, r in enumerate(train.records):
        counts.index_add_(0, torch.tensor(r.tokens[r.prompt_len :], dtype=torch.long),
                          torch.ones(len(r.tokens) - r.prompt_len, dtype=torch.long))
        top1 = cache["t_idx"][train.a_off[k] : train.a_off[k] + r.num_answer, 0].long()
        counts.index_add_(0, top1, torch.ones_like(top1))
    return torch.argsort(-counts * vocab + torch.arange(vocab))


@dataclass
class Progress:
    """Where a run stands: what a checkpoint holds besides the weights."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None  # {"epoch", "metrics", "adapter": state dict} of the best epoch
    resumed: bool = False


class AdapterRun:
    """The adapter, its optimiser and the run's progress; trains epoch by epoch, checkpoints, resumes."""

    def __init__(self, args: argparse.Namespace, model: LlamaForCausalLM, data: Data, out: Path) -> None:
        self.args, self.model, self.data = args, model, data
        self.head = Head(model, data.ranked, args.vocab_subset)
        self.adapter = ExitAdapter.from_target(model, args.layer, args.init, args.adapter_layers, args.features)
        for prm in self.adapter.parameters():
            prm.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.adapter.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        self.key = {**data.cache_key, "layer": args.layer, "adapter_layers": args.adapter_layers,
                    "init": args.init, "vocab_subset": args.vocab_subset, "val_fraction": args.val_fraction,
                    "seed": args.seed, "batch_tokens": args.batch_tokens, "hard_weight": args.hard_weight,
                    "temperature": args.temperature}
        if args.features:
            self.key.update(features=True, feature_weight=args.feature_weight, chain_steps=args.chain_steps)
        self.ckpt = out / "checkpoint"
        self.progress = Progress()
        if has_checkpoint(self.ckpt) and not args.fresh:
            self.resume()

    def resume(self) -> None:
        st = load_checkpoint(self.ckpt, "--fresh")
        if st.get("key") != self.key:
            raise ValueError(f"{self.ckpt} belongs to a run with other settings; pass --fresh to start over or use "
                             "another --out")
        self.adapter.load_state_dict(st["adapter"])
        self.opt.load_state_dict(st["opt"])
        self.progress = Progress(st["epoch"], st["step_in_epoch"], st["global_step"], st["history"], st["best"],
                                 resumed=True)
        print(f"resuming from {self.ckpt}: epoch {st['epoch'] + 1}, step {st['step_in_epoch']}")

    def save(self) -> None:
        p = self.progress
        save_checkpoint(self.ckpt, {"key": self.key, "adapter": self.adapter.state_dict(),
                                    "opt": self.opt.state_dict(), "epoch": p.epoch, "step_in_epoch": p.step_in_epoch,
                                    "global_step": p.global_step, "history": p.history, "best": p.best})

    def report(self, tag: str, m: dict[str, float]) -> None:
        line = (f"[{tag}] val loss {m['val_loss']:.4f} | top-1 agreement {m['agree']:.1%} "
                f"(~{expected_tokens(m['agree'], 3):.2f} tokens/step at 3 drafts) | "
                f"p>={self.args.min_draft_prob}: {m['confident']:.0%} of positions, {m['agree_confident']:.1%} agree")
        if "agree_own_features" in m:
            line += f" | from its own features (2nd+ chain tokens) {m['agree_own_features']:.1%}"
        if "agree_subset_head" in m:
            line += (f" | subset head ({self.head.size}) agreement {m['agree_subset_head']:.1%}, teacher top-1 "
                     f"in subset {m['teacher_top1_in_subset']:.1%}")
        print(line, flush=True)

    def validate(self) -> dict[str, float]:
        self.adapter.eval()
        return evaluate(self.adapter, self.model, self.data.val, self.data.cache, self.head, self.args)

    def step(self, idx: list[int], total: int) -> float:
        """One optimiser step on the records ``idx`` of the training split; returns the loss."""
        a, p0 = self.args, next(self.adapter.parameters())
        b = gather_batch(self.data.train, idx, self.data.cache, p0.device, p0.dtype)
        outs, feats = dense_passes(self.adapter, self.model, b, a.chain_steps)
        loss = sum(distill_loss(o[b.mask], self.head, b.t_val, b.t_idx, a.hard_weight, a.temperature)
                   for o in outs) / len(outs)
        if feats is not None and a.feature_weight > 0:  # EAGLE's regression: stay close to f for the next step
            loss = loss + a.feature_weight * sum(F.smooth_l1_loss(o[b.real], feats[b.real])
                                                 for o in outs) / len(outs)
        for g in self.opt.param_groups:
            g["lr"] = warmup_cosine_lr(self.progress.global_step, total, a.warmup, a.lr)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.adapter.parameters(), 1.0)
        self.opt.step()
        return loss.detach().item()

    def train(self) -> float:
        """Epochs up to ``--epochs`` (epoch 0, the untrained start, is validated first); returns seconds."""
        a, p = self.args, self.progress
        if not p.history:  # epoch 0: the untrained initialisation (early-exit baseline)
            m0 = self.validate()
            p.history.append({"epoch": 0, "train_loss": None, **m0})
            self.report("init", m0)
        total = len(plan_batches(self.data.train, a.batch_tokens, a.seed)) * a.epochs
        t0 = time.time()
        while p.epoch < a.epochs:
            batches = plan_batches(self.data.train, a.batch_tokens, a.seed + 1000 * p.epoch)
            self.adapter.train()
            bar = tqdm(total=len(batches), initial=p.step_in_epoch, desc=f"epoch {p.epoch + 1}/{a.epochs}",
                       unit="step")
            losses: list[float] = []
            while p.step_in_epoch < len(batches):
                losses.append(self.step(batches[p.step_in_epoch], total))
                p.step_in_epoch += 1
                p.global_step += 1
                bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
                bar.update(1)
                if a.save_every and p.global_step % a.save_every == 0:
                    self.save()
            bar.close()
            self.end_epoch(losses)
        return time.time() - t0

    def end_epoch(self, losses: list[float]) -> None:
        p = self.progress
        m = self.validate()
        p.epoch += 1
        p.step_in_epoch = 0
        train_loss = sum(losses) / len(losses) if losses else None
        p.history.append({"epoch": p.epoch, "train_loss": train_loss, **m})
        self.report(f"epoch {p.epoch}" + (f" train loss {train_loss:.4f}" if train_loss is not None else ""), m)
        if p.best is None or m["agree"] > p.best["metrics"]["agree"]:
            p.best = {"epoch": p.epoch, "metrics": m,
                      "adapter": {k: v.detach().clone() for k, v in self.adapter.state_dict().items()}}
        self.save()


def export(run: AdapterRun, model_path: Path, out: Path, seconds: dict[str, float]) -> dict[str, Any]:
    """Write the artifact (the best epoch's weights) and its record; returns the validation it was chosen by."""
    args, p, head = run.args, run.progress, run.head
    if p.best is not None:
        run.adapter.load_state_dict(p.best["adapter"])
    final = p.best["metrics"] if p.best is not None else p.history[-1]
    extra = {"init": args.init, "min_draft_prob": args.min_draft_prob, "draft_vocab": 0, "loss_vocab": head.size,
             "best_epoch": p.best["epoch"] if p.best is not None else 0, "validation": final}
    estimate = None
    if not args.no_estimate:
        run.adapter.eval()
        estimate = estimate_speed(run.model, model_path, run.adapter, run.data.ranked, final,
                                  head.size if head.ids is not None else 0, args.dtype, args.device)
        print_estimate(estimate, head.size)
        extra["speed_estimate"] = estimate
    save_adapter(run.adapter, out, run.model, extra, vocab_ranked=run.data.ranked)
    d = run.data
    train_recs, val_recs = d.train.records, d.val.records
    write_record(out, {
        "command": command_line(args), "seed": args.seed,
        "args": {k: v for k, v in vars(args).items() if k not in ("func", "train_func")},
        "model": str(model_path), "target_fingerprint": target_fingerprint(run.model),
        "data": {"file": str(d.data_file), "sha256": d.sha256, "manifest": read_manifest(d.data_file),
                 "num_records": len(d.records), "train_records": len(train_recs), "val_records": len(val_recs),
                 "train_positions": sum(r.num_answer for r in train_recs),
                 "val_positions": sum(r.num_answer for r in val_recs)},
        "history": p.history, "speed_estimate": estimate, "resumed": p.resumed,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "threads": torch.get_num_threads(), "torch": torch.__version__,
    })
    return {"best_epoch": extra["best_epoch"], **final}


def print_estimate(estimate: dict[str, Any], subset: int) -> None:
    for name in ("full", f"subset{subset}"):
        e = estimate.get(name)
        if e:
            print(f"speed estimate ({name} head, batch 1, this machine now): draft step {e['draft_step_ms']} ms "
                  f"= {e['draft_over_target']:.0%} of a target step ({estimate['target_step_ms']} ms); at "
                  f"{e['agreement']:.1%} agreement the best chain is {e['best_gamma']} drafts, "
                  f"~{e['est_speedup']:.2f}x")


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run (``train eagle`` implies ``--features``)."""
    draft = args.train_command in ("draft-model", "eagle")
    skip = ("func", "train_func", "command", "train_command") + (("layer",) if draft else ()) + \
        (("features",) if args.train_command == "eagle" else ())
    parts = []
    for k, v in vars(args).items():
        if k in skip or v is None or v is False or (k in ("feature_weight", "chain_steps") and not args.features):
            continue
        flag = "--layers" if draft and k == "adapter_layers" else "--" + k.replace("_", "-")
        parts.append(flag if v is True else f"{flag} {v}")
    return f"leapdecode train {args.train_command} " + " ".join(parts)


def cmd_self_spec(args: argparse.Namespace) -> int:
    t_start = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    kind = f"self_spec_L{args.layer}" if args.layer else "eagle" if args.features else "draft"
    out = Path(args.out or (f"runs/{kind}" if args.layer else f"runs/{kind}_{args.adapter_layers}l"))
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model)
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}")
    model, cfg = load_model(model_path, DTYPES[args.dtype], args.device)
    check_args(args, cfg.num_hidden_layers)
    data = prepare_data(args, model, model_path, out)
    run = AdapterRun(args, model, data, out)
    train_s = run.train()
    final = export(run, model_path, out, {"cache": data.cache_seconds, "train": train_s,
                                          "total": time.time() - t_start})
    method = "self_spec" if args.layer else "eagle" if args.features else "draft_model"
    print(f"wrote the {'adapter' if args.layer else 'draft'} to {out} (best epoch {final['best_epoch']}, top-1 "
          f'agreement {final["agree"]:.1%}); use speculative_config={{"method": "{method}", "model": "{out}"}}')
    return 0


__all__ = ["AdapterRun", "Head", "adapter_caches", "cmd_self_spec", "dense_passes", "distill_loss", "evaluate",
           "fill_adapter_caches"]

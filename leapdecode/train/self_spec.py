"""``leapdecode train self-spec``: train the exit adapter that self-speculation drafts with.

The drafter is ``LMHead(norm(adapter(h_L)))`` (speculative/methods/self_spec.py). Training makes its
next-token distribution match the target's on the target's own answers (``leapdecode train distill-data``):

1. **Cache once.** One pass of the target over every record stores ``h_L`` (the residual stream after layer L,
   every position, float16) and the teacher's top-k logits at the answer positions; the teacher cache does not
   depend on L, so trying another L only reruns layers [0, L). Caches are keyed by the data's hash and the
   settings, so a rerun reuses them.
2. **Train** the adapter alone (the target, its LM head included, stays frozen) with a soft cross-entropy to the
   teacher's top-k distribution, optionally mixed with hard cross-entropy to its argmax. The 49k-row LM head
   dominates the cost of a small model's training step, so by default the loss scores only a frequency-ranked
   vocabulary subset (``--vocab-subset``, measured from the training answers); validation reports agreement with
   both the full head and the subset head, so what the subset costs is measured, not guessed.
3. **Validate** every epoch on held-out prompts: top-1 agreement with the target (what a greedy draft token's
   acceptance rate is), coverage and agreement above the drafting threshold, and the loss. Epoch 0 is the
   untrained initialisation, i.e. the early-exit baseline.
4. **Checkpoint** every ``--save-every`` steps and each epoch (rerun the same command to resume), and write the
   artefact: ``adapter.safetensors`` (best validation epoch), ``config.json``, ``record.json`` (exact command,
   data manifest and hash, seed, history, timings). ``speculative_config={"method": "self_spec", "model": OUT}``
   loads it; copy it to ``leapdecode/artifacts/self_spec/`` to ship it as the default.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ForwardItem, ModelRunner
from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.speculative.artifacts import RECORD_FILE, save_adapter, target_fingerprint
from leapdecode.speculative.exit_adapter import ExitAdapter
from leapdecode.speculative.methods.eagle import EagleProposer
from leapdecode.speculative.methods.self_spec import SelfSpecProposer
from leapdecode.speculative.policy import StepCostModel, scratch_step
from leapdecode.speculative.proposer import EngineView
from leapdecode.speculative.shadow_cache import Shadow

CACHE_BLOCK = 16


# ----------------------------------------------------------------------------------------------------- data
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


def data_file_of(path: str | Path) -> Path:
    p = Path(path)
    f = p / "samples.jsonl" if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"no samples.jsonl at {path}; create it with `leapdecode train distill-data`")
    return f


def load_records(path: Path, max_seq_len: int, limit: int | None) -> list[Record]:
    """Records truncated to ``max_seq_len`` tokens; a record whose prompt alone fills that is skipped."""
    out: list[Record] = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            r = json.loads(line)
            prompt, answer = list(r["prompt_token_ids"]), list(r["output_token_ids"])
            if not prompt or len(prompt) >= max_seq_len:
                continue
            toks = (prompt + answer)[:max_seq_len]
            out.append(Record(f"{r.get('id', i)}", toks, len(prompt)))
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


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------- cache
@torch.inference_mode()
def compute_cache(
    model: LlamaForCausalLM,
    records: list[Record],
    layer: int,
    topk: int,
    teacher: bool,
    batch_tokens: int,
    desc: str,
) -> dict[str, Any]:
    """Run the target over ``records`` (many per forward, through the engine's paged attention) and return
    ``hidden`` [sum T, H] float16 (h_L at every position, records concatenated) and, if ``teacher``, the top-k
    teacher logits ``t_val`` [sum A, k] float16 and ids ``t_idx`` [sum A, k] int32 at the answer positions."""
    cfg = model.config
    p = next(model.parameters())
    longest = max(len(r.tokens) for r in records)
    cap = max(batch_tokens, longest)
    blocks = cap // CACHE_BLOCK + cap // max(1, min(len(r.tokens) for r in records)) + 2
    kv = KVCache(cfg, blocks, CACHE_BLOCK, p.dtype, p.device)
    bm = BlockManager(blocks, CACHE_BLOCK, enable_prefix_caching=False)
    runner = ModelRunner(model, kv, CACHE_BLOCK, p.device)
    hidden: list[torch.Tensor] = []
    t_val: list[torch.Tensor] = []
    t_idx: list[torch.Tensor] = []
    bar = tqdm(total=sum(len(r.tokens) for r in records), desc=desc, unit="tok", unit_scale=True)
    i = 0
    while i < len(records):
        batch: list[Record] = []
        used = 0
        while i < len(records) and (not batch or used + len(records[i].tokens) <= batch_tokens):
            batch.append(records[i])
            used += len(records[i].tokens)
            i += 1
        shadows = [Shadow() for _ in batch]
        for sh, r in zip(shadows, batch):
            bm.allocate(sh, len(r.tokens))  # type: ignore[arg-type]
        items = [ForwardItem(sh.block_table, 0, r.tokens, list(range(r.prompt_len - 1, len(r.tokens))))
                 for sh, r in zip(shadows, batch)]
        ids, pos, meta, rows = runner.prepare(items)
        h = model(ids, pos, kv.layers, meta, layers=range(layer), final_norm=False)
        hidden.append(h.to("cpu", torch.float16))
        if teacher:
            out = model(ids, pos, kv.layers, meta, layers=range(layer, cfg.num_hidden_layers), hidden=h)
            logits = model.compute_logits(out.index_select(0, rows)).float()
            v, ix = logits.topk(topk, dim=-1)
            t_val.append(v.to("cpu", torch.float16))
            t_idx.append(ix.to("cpu", torch.int32))
        for sh in shadows:
            bm.free(sh)  # type: ignore[arg-type]
        bar.update(used)
    bar.close()
    out_d: dict[str, Any] = {"hidden": torch.cat(hidden)}
    if teacher:
        out_d["t_val"], out_d["t_idx"] = torch.cat(t_val), torch.cat(t_idx)
    return out_d


def cached(path: Path, key: dict[str, Any], build) -> dict[str, Any]:
    """Load ``path`` when its stored key equals ``key``, else build and save it (atomically)."""
    if path.is_file():
        d = torch.load(path, weights_only=True)
        if d.get("key") == json.dumps(key, sort_keys=True):
            return d
    d = build()
    d["key"] = json.dumps(key, sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(d, tmp)
    os.replace(tmp, path)
    return d


# ------------------------------------------------------------------------------------------------- batching
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


def expected_accepted(alpha: float, gamma: int) -> float:
    """Tokens per verification for a chain of ``gamma`` drafts, each accepted with probability ``alpha``."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


@torch.inference_mode()
def estimate_speed(model: LlamaForCausalLM, model_path: Path, adapter: ExitAdapter, ranked: torch.Tensor,
                   metrics: dict[str, float], subset: int, dtype: str, device: str) -> dict[str, Any]:
    """Time a target step (1..9 tokens) and a draft step (layers [0, L) + adapter + LM head, full or subset) on
    this machine, now, at batch 1, and combine them with the held-out agreement into the best chain length and
    its speedup, assuming each draft is accepted independently with that probability. A guide for choosing L
    (the draft's cost grows with L, its agreement too), not a benchmark: run ``leapdecode bench`` for that."""
    from leapdecode.config import EngineConfig
    from leapdecode.engine.llm_engine import LLMEngine

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
        prop = kind(EngineView.of(eng), adapter, 0.0, ranked[:n] if n else None)
        d1 = StepCostModel.calibrate(prop.timed_draft_step, sizes=(1,), repeats=5)(1)
        best_g, best_x = 0, 1.0
        for g in range(1, 9):
            x = expected_accepted(alpha, g) * t1 / (target(1 + g) + g * d1)
            if x > best_x:
                best_g, best_x = g, x
        out[name] = {"draft_step_ms": round(d1 * 1e3, 2), "draft_over_target": round(d1 / t1, 3),
                     "agreement": round(alpha, 4), "best_gamma": best_g, "est_speedup": round(best_x, 3)}
    eng.runner.captures.clear()
    return out


# -------------------------------------------------------------------------------------------------- command
def _command_line(args: argparse.Namespace) -> str:
    draft = args.train_command == "draft"
    skip = ("func", "train_func", "command", "train_command") + (("layer",) if draft else ())
    parts = []
    for k, v in vars(args).items():
        if k in skip or v is None or v is False or (k in ("feature_weight", "chain_steps") and not args.features):
            continue
        flag = "--layers" if draft and k == "adapter_layers" else "--" + k.replace("_", "-")
        parts.append(flag if v is True else f"{flag} {v}")
    return f"leapdecode train {args.train_command} " + " ".join(parts)


def _lr_at(step: int, total: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine down to 10% of ``--lr``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def cmd_self_spec(args: argparse.Namespace) -> int:
    from leapdecode.config import DTYPES
    from leapdecode.models.loader import load_model, resolve_model

    t_start = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data_file = data_file_of(args.data)
    out = Path(args.out or (f"runs/self_spec_L{args.layer}" if args.layer else f"runs/draft_{args.adapter_layers}l"))
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model)
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}")
    model, cfg = load_model(model_path, DTYPES[args.dtype], args.device)
    if not 0 <= args.layer < cfg.num_hidden_layers:
        raise ValueError(f"--layer must be in [0, {cfg.num_hidden_layers - 1}] for this model, got {args.layer}")
    if args.features and args.layer:
        raise ValueError("--features is for drafts (`leapdecode train draft`): they share no target layers")
    if args.chain_steps < 1:
        raise ValueError(f"--chain-steps must be >= 1, got {args.chain_steps}")
    if not 1 <= args.adapter_layers <= cfg.num_hidden_layers - args.layer:
        raise ValueError(f"--adapter-layers must be in [1, {cfg.num_hidden_layers - args.layer}], got "
                         f"{args.adapter_layers}")
    records = load_records(data_file, args.max_seq_len, args.max_records)
    if len(records) < 2:
        raise ValueError(f"{data_file} has fewer than 2 usable records")
    train_recs, val_recs = split_records(records, args.val_fraction, args.seed)
    data_hash = sha256_of(data_file)
    manifest_path = data_file.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None

    # 1. caches (teacher independent of L; h_L per L)
    t0 = time.time()
    base_key = {"data": data_hash, "model": str(model_path), "dtype": args.dtype, "max_seq_len": args.max_seq_len,
                "max_records": args.max_records}
    teacher_key = {**base_key, "topk": args.topk}
    cache_dir = Path(args.cache_dir) if args.cache_dir else out / "cache"
    # a feature draft reads the target's top-layer features, every other drafter h_L
    cache_layer = cfg.num_hidden_layers if args.features else args.layer
    tpath, hpath = cache_dir / "teacher.pt", cache_dir / f"hidden_L{cache_layer}.pt"
    tcache: dict[str, Any] = {}

    def build_teacher() -> dict[str, Any]:
        d = compute_cache(model, records, cache_layer, args.topk, True, args.cache_tokens, "cache h_L + teacher")
        tcache["hidden"] = d.pop("hidden")  # computed on the way: save it too
        return d

    teacher = cached(tpath, teacher_key, build_teacher)
    if "hidden" in tcache:
        hidden = cached(hpath, {**base_key, "layer": cache_layer}, lambda: {"hidden": tcache.pop("hidden")})
    else:
        hidden = cached(hpath, {**base_key, "layer": cache_layer},
                        lambda: compute_cache(model, records, cache_layer, args.topk, False, args.cache_tokens,
                                              f"cache h_L (L={cache_layer})"))
    cache = {"hidden": hidden["hidden"], "t_val": teacher["t_val"], "t_idx": teacher["t_idx"]}
    cache_s = time.time() - t0
    train, val = make_split(train_recs, records), make_split(val_recs, records)

    # 2. vocabulary ranking from the training split (answers and teacher argmaxes)
    counts = torch.zeros(cfg.vocab_size, dtype=torch.long)
    for k, r in enumerate(train.records):
        counts.index_add_(0, torch.tensor(r.tokens[r.prompt_len :], dtype=torch.long),
                          torch.ones(len(r.tokens) - r.prompt_len, dtype=torch.long))
        top1 = cache["t_idx"][train.a_off[k] : train.a_off[k] + r.num_answer, 0].long()
        counts.index_add_(0, top1, torch.ones_like(top1))
    ranked = torch.argsort(-counts * cfg.vocab_size + torch.arange(cfg.vocab_size))  # by count, then id (stable)
    head = Head(model, ranked, args.vocab_subset)

    # 3. adapter, optimiser, resume
    adapter = ExitAdapter.from_target(model, args.layer, args.init, args.adapter_layers, args.features)
    for prm in adapter.parameters():
        prm.requires_grad_(True)
    opt = torch.optim.AdamW(adapter.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    run_key = {**teacher_key, "layer": args.layer, "adapter_layers": args.adapter_layers, "init": args.init,
               "vocab_subset": args.vocab_subset,
               "val_fraction": args.val_fraction, "seed": args.seed, "batch_tokens": args.batch_tokens,
               "hard_weight": args.hard_weight, "temperature": args.temperature}
    if args.features:
        run_key.update(features=True, feature_weight=args.feature_weight, chain_steps=args.chain_steps)
    ckpt_path = out / "checkpoint.pt"
    epoch, step_in_epoch, global_step = 0, 0, 0
    history: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    resumed = False
    if ckpt_path.is_file() and not args.fresh:
        ck = torch.load(ckpt_path, weights_only=False)
        if ck["key"] != run_key:
            raise ValueError(f"{ckpt_path} belongs to a run with other settings; pass --fresh to start over or use "
                             "another --out")
        adapter.load_state_dict(ck["adapter"])
        opt.load_state_dict(ck["opt"])
        epoch, step_in_epoch, global_step = ck["epoch"], ck["step_in_epoch"], ck["global_step"]
        history, best = ck["history"], ck["best"]
        resumed = True
        print(f"resuming from {ckpt_path}: epoch {epoch + 1}, step {step_in_epoch}")

    def save_checkpoint() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"key": run_key, "adapter": adapter.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                    "step_in_epoch": step_in_epoch, "global_step": global_step, "history": history,
                    "best": best}, tmp)
        os.replace(tmp, ckpt_path)

    def report(tag: str, metrics: dict[str, float]) -> None:
        line = (f"[{tag}] val loss {metrics['val_loss']:.4f} | top-1 agreement {metrics['agree']:.1%} "
                f"(~{expected_accepted(metrics['agree'], 3):.2f} tokens/step at 3 drafts) | "
                f"p>={args.min_draft_prob}: {metrics['confident']:.0%} of positions, {metrics['agree_confident']:.1%} "
                "agree")
        if "agree_own_features" in metrics:
            line += f" | from its own features (2nd+ chain tokens) {metrics['agree_own_features']:.1%}"
        if "agree_subset_head" in metrics:
            line += (f" | subset head ({head.size}) agreement {metrics['agree_subset_head']:.1%}, teacher top-1 "
                     f"in subset {metrics['teacher_top1_in_subset']:.1%}")
        print(line, flush=True)

    p0 = next(adapter.parameters())
    if not history:  # epoch 0: the untrained initialisation (early-exit baseline)
        adapter.eval()
        m0 = evaluate(adapter, model, val, cache, head, args)
        history.append({"epoch": 0, "train_loss": None, **m0})
        report("init", m0)
    steps_per_epoch = len(plan_batches(train, args.batch_tokens, args.seed))
    total = steps_per_epoch * args.epochs
    t_train = time.time()
    while epoch < args.epochs:
        batches = plan_batches(train, args.batch_tokens, args.seed + 1000 * epoch)
        adapter.train()
        bar = tqdm(total=len(batches), initial=step_in_epoch, desc=f"epoch {epoch + 1}/{args.epochs}", unit="step")
        losses: list[float] = []
        while step_in_epoch < len(batches):
            b = gather_batch(train, batches[step_in_epoch], cache, p0.device, p0.dtype)
            outs, feats = dense_passes(adapter, model, b, args.chain_steps)
            loss = sum(distill_loss(o[b.mask], head, b.t_val, b.t_idx, args.hard_weight, args.temperature)
                       for o in outs) / len(outs)
            if feats is not None and args.feature_weight > 0:  # EAGLE's regression: stay close to f for the next step
                loss = loss + args.feature_weight * sum(F.smooth_l1_loss(o[b.real], feats[b.real])
                                                        for o in outs) / len(outs)
            for g in opt.param_groups:
                g["lr"] = _lr_at(global_step, total, args)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
            opt.step()
            losses.append(loss.detach().item())
            step_in_epoch += 1
            global_step += 1
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
            bar.update(1)
            if args.save_every and global_step % args.save_every == 0:
                save_checkpoint()
        bar.close()
        adapter.eval()
        m = evaluate(adapter, model, val, cache, head, args)
        epoch += 1
        step_in_epoch = 0
        train_loss = sum(losses) / len(losses) if losses else None
        history.append({"epoch": epoch, "train_loss": train_loss, **m})
        report(f"epoch {epoch}" + (f" train loss {train_loss:.4f}" if train_loss is not None else ""), m)
        if best is None or m["agree"] > best["metrics"]["agree"]:
            best = {"epoch": epoch, "metrics": m,
                    "adapter": {k: v.detach().clone() for k, v in adapter.state_dict().items()}}
        save_checkpoint()
    train_s = time.time() - t_train

    # 4. artefact
    if best is not None:
        adapter.load_state_dict(best["adapter"])
    final = best["metrics"] if best is not None else history[-1]
    extra = {
        "init": args.init,
        "min_draft_prob": args.min_draft_prob,
        "draft_vocab": 0,
        "loss_vocab": head.size,
        "best_epoch": best["epoch"] if best is not None else 0,
        "validation": final,
    }
    estimate = None
    if not args.no_estimate:
        adapter.eval()
        estimate = estimate_speed(model, model_path, adapter, ranked, final, head.size if head.ids is not None else 0,
                                  args.dtype, args.device)
        for name in ("full", f"subset{head.size}"):
            e = estimate.get(name)
            if e:
                print(f"speed estimate ({name} head, batch 1, this machine now): draft step {e['draft_step_ms']} ms "
                      f"= {e['draft_over_target']:.0%} of a target step ({estimate['target_step_ms']} ms); at "
                      f"{e['agreement']:.1%} agreement the best chain is {e['best_gamma']} drafts, "
                      f"~{e['est_speedup']:.2f}x")
        extra["speed_estimate"] = estimate
    save_adapter(adapter, out, model, extra, vocab_ranked=ranked)
    record = {
        "command": _command_line(args),
        "seed": args.seed,
        "args": {k: v for k, v in vars(args).items() if k not in ("func", "train_func")},
        "model": str(model_path),
        "target_fingerprint": target_fingerprint(model),
        "data": {"file": str(data_file), "sha256": data_hash, "manifest": manifest, "num_records": len(records),
                 "train_records": len(train_recs), "val_records": len(val_recs),
                 "train_positions": sum(r.num_answer for r in train_recs),
                 "val_positions": sum(r.num_answer for r in val_recs)},
        "history": history,
        "speed_estimate": estimate,
        "resumed": resumed,
        "seconds": {"cache": round(cache_s, 1), "train": round(train_s, 1), "total": round(time.time() - t_start, 1)},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    (out / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    method = "self_spec" if args.layer else "eagle" if args.features else "draft_model"
    print(f"wrote the {'adapter' if args.layer else 'draft'} to {out} (best epoch {extra['best_epoch']}, top-1 "
          f'agreement {final["agree"]:.1%}); use speculative_config={{"method": "{method}", "model": "{out}"}}')
    return 0


def add_cli(tsub) -> None:
    p = tsub.add_parser(
        "self-spec",
        help="train the exit adapter for self-speculation (target layers [0, L) + adapter + shared LM head)",
        description="Caches the target's layer-L hidden states and top-k logits on the distillation data once, "
        "then trains an exit adapter (one decoder layer by default) to match the target's next-token "
        "distribution. Prints held-out top-1 agreement each epoch (epoch 0 = untrained early exit), checkpoints as "
        "it goes (rerun the same command to resume) and writes adapter.safetensors + config.json + record.json "
        "to --out.",
    )
    p.add_argument("--layer", type=int, required=True, help="L: target layers shared by the drafter")
    p.add_argument("--adapter-layers", type=int, default=1, help="decoder layers in the adapter")
    p.add_argument("--init", default="last", choices=["next", "last"],
                   help="start the adapter from the target's last layers (last; better in a probe on SmolLM2 at "
                   "L=15) or from layers L.. (next), the layers that read h_L in the target")
    _common_args(p)
    d = tsub.add_parser(
        "draft",
        help="distil a small draft model (N decoder layers sharing the target's embedding and LM head)",
        description="Trains a draft of --layers decoder layers (initialised from target layers) over the target's "
        "own embedding, with the target's final norm and LM head, to match the target's next-token distribution "
        "on the distillation data: self-spec with no shared layers, the same cache, loss, validation, checkpoints "
        "and artefact. speculative_config={\"method\": \"draft_model\", \"model\": OUT} drafts with it; "
        "leapdecode/artifacts/draft/ is the one used without a path.",
    )
    d.add_argument("--layers", dest="adapter_layers", type=int, default=3,
                   help="decoder layers in the draft (3 of SmolLM2's 30 = 1/10 of its non-embedding parameters)")
    d.add_argument("--init", default="next", choices=["next", "last"],
                   help="start from the target's first layers (next) or its last layers (last)")
    _common_args(d)
    d.set_defaults(layer=0)


def _common_args(p) -> None:
    p.add_argument("--data", required=True, help="folder with samples.jsonl (leapdecode train distill-data), or it")
    p.add_argument("--out", default=None, help="output folder (default runs/self_spec_L<L> or runs/draft_<N>l)")
    p.add_argument("--model", default=None, help="target model (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--cache-dir", default=None,
                   help="where cached hidden states / teacher logits live (default OUT/cache); share it between "
                   "runs (several L, drafts) so the teacher pass runs once")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per training step")
    p.add_argument("--cache-tokens", type=int, default=4096, help="tokens per target forward while caching")
    p.add_argument("--topk", type=int, default=16, help="teacher logits kept per position")
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    p.add_argument("--hard-weight", type=float, default=0.0, help="weight of hard CE to the teacher argmax")
    p.add_argument("--vocab-subset", type=int, default=8192,
                   help="score the loss over the N most frequent tokens only (0 = full LM head, ~4x slower "
                   "steps on SmolLM2)")
    p.add_argument("--min-draft-prob", type=float, default=0.3,
                   help="drafting threshold stored in the artefact and used for the confidence metrics")
    p.add_argument("--features", action="store_true",
                   help="train a feature-conditioned draft (EAGLE-style; `train draft` only): its input is the "
                   "target's final hidden state one position back fused with the current token's embedding")
    p.add_argument("--feature-weight", type=float, default=0.3,
                   help="feature drafts: weight of the smooth-L1 loss to the target's next feature")
    p.add_argument("--chain-steps", type=int, default=2,
                   help="feature drafts: training passes per batch, each after the first fed the draft's own "
                   "features (as the 2nd and later tokens of a chain are drafted)")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--max-records", type=int, default=None, help="use only the first N records")
    p.add_argument("--max-seq-len", type=int, default=1024, help="truncate prompt + answer to this many tokens")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and every epoch)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint in --out")
    p.add_argument("--no-estimate", action="store_true",
                   help="skip timing draft and target steps for the speedup estimate at the end")
    p.set_defaults(train_func=cmd_self_spec)

"""Blockwise parallel decoding (Stern, Shazeer & Uszkoreit 2018): predict k tokens at once, verify, accept.

**Predict.** k proposal heads (``block_heads.py``): slot i predicts the token i places after the one the target
emits from its newest hidden state, reading that hidden state and the text of the current block (the last
``num_blocks * k`` tokens, the newest one the target just emitted) through one attention layer under the
block-causal mask they were trained with (``leapdecode train blockwise``: every block of a training stretch in
parallel, gradient checkpointed per block). Each slot proposes its top-1 token, so a step drafts a *chain*,
verified in the engine's plain causal layout. A folder of n heads serves every k <= n (the first k slots); the
shipped ones (``leapdecode/artifacts/blockwise/``) have n = 8.

**Verify.** One target forward over ``[last token] + drafts`` gives the target's logits at each draft position
(conditioned on the drafts before it), exactly Stern et al.'s verify substep.

**Accept** (``acceptance``):

- ``"exact"`` (default, lossless): greedy requests keep drafts while each equals the target's argmax, then emit
  the target's argmax at the first mismatch (or after the last draft) -- token-identical to plain greedy
  decoding. Sampled requests walk the chain drawing ``x ~ p`` at each position and keep the draft while it
  equals ``x`` (the one-path case of ``acceptance.verify_tree_sampling``): every emitted token is one draw from the
  target's distribution with the request's generator, so a seeded request reproduces plain seeded sampling.
- ``"topk"`` (lossy, opt-in; Stern et al. §5 "top-k selection"): draft i is kept if it is among the target's
  ``top_k`` tokens at its position -- fewer than ``top_k`` tokens score strictly higher, so ties favour the
  draft and the argmax always passes; for sampled requests the ranking is of the request's processed
  distribution and a token it gives zero probability never passes. With ``min_block = m`` (Stern et al.'s
  minimum block size, counted here in *proposed* tokens) the first m drafts are kept without the test, so a
  step emits at least m + 1 tokens. Acceptance stops at the first draft that fails; the next token is the
  target's argmax (greedy) or a draw from its distribution (sampled) after the last kept draft. Because the
  argmax is always in the top k, top-k mode keeps every draft exact mode keeps, given the same logits. The
  kept drafts' K/V were written by the verification forward, so the engine just commits them.
  ``RequestMetrics.num_lossy_tokens`` counts the kept drafts that were *not* the target's top choice: how far
  a lossy run strayed, per request.

**Block size.** Exact mode obeys the engine's step-cost model like every other drafter: each step drafts the n
<= k proposals whose expected tokens per second (the chain's acceptance by position, starting from the heads'
held-out validation and updated by every verification) beat plain decoding's at the running batch, and 0 (plain
decoding) when none do. With ``use_cost_model: false`` it drafts all k. Top-k mode drafts its full block every
step (``Proposer.fixed_budget``): a lossy run's output must not depend on the machine's timing through the cost
model.

Config: ``speculative_config={"method": "blockwise", "num_speculative_tokens": k, "acceptance": "exact" | "topk",
"top_k": int, "min_block": int, "model": HEADS_DIR}``; ``k`` defaults to every head in the folder, ``model`` to
the shipped heads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.sequence import Sequence
from leapdecode.layers.sampler import processed_probs
from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.parallel import rank0_value
from leapdecode.speculative.acceptance import verify_block_topk, verify_tree_sampling
from leapdecode.speculative.artifacts import (
    BLOCK_HEADS_TYPE,
    BLOCKWISE_DIR,
    check_heads_fit,
    load_block_heads,
    shipped_heads_for,
)
from leapdecode.speculative.block_heads import BlockHeads
from leapdecode.speculative.heads import HeadsProposer
from leapdecode.speculative.method import AutoUse, Method
from leapdecode.speculative.options import check, is_int
from leapdecode.speculative.proposer import EngineView, Proposal, StepCost, Verification
from leapdecode.speculative.router import AutoOptions, extreme_latency

DEFAULT_TOP_K = 2
PRIOR_WEIGHT = 32.0  # verifications the held-out acceptance counts for against those measured here
FALLBACK_ACCEPTANCE = 0.3  # per position, for heads whose artifact carries no validation
Acceptance = Literal["exact", "topk"]
ACCEPTANCE: tuple[str, ...] = get_args(Acceptance)


@dataclass(frozen=True)
class BlockwiseOptions:
    """Blockwise acceptance (methods/blockwise.py): ``"exact"`` (lossless) or opt-in lossy ``"topk"``, where a
    draft among the target's ``top_k`` best passes and the first ``min_block`` drafts pass regardless. ``None``:
    not given; exact acceptance refuses both rather than ignoring them (it is lossless and has nothing for them
    to change)."""

    acceptance: Acceptance = "exact"
    top_k: int | None = None
    min_block: int | None = None

    def __post_init__(self) -> None:
        check(self.acceptance in ACCEPTANCE,
               f"blockwise acceptance must be one of {ACCEPTANCE}, got {self.acceptance!r}")
        if self.acceptance == "exact":
            given = [k for k in ("top_k", "min_block") if getattr(self, k) is not None]
            check(not given, f"{', '.join(given)} only apply to acceptance='topk' (lossy, opt-in); exact "
                              "acceptance is lossless and takes neither")
        check(self.top_k is None or is_int(self.top_k, 1),
               f"blockwise top_k must be an integer >= 1, got {self.top_k!r}")
        check(self.min_block is None or is_int(self.min_block, 0),
               f"blockwise min_block must be an integer in [0, k] (proposed tokens kept without the top-k test), "
               f"got {self.min_block!r}")


@dataclass(frozen=True)
class BlockwiseSettings:
    """One blockwise configuration resolved against its heads folder (see the module docstring)."""

    k: int
    acceptance: Acceptance = "exact"
    top_k: int = DEFAULT_TOP_K
    min_block: int = 0

    @property
    def lossy(self) -> bool:
        return self.acceptance == "topk"

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, num_heads: int) -> BlockwiseSettings:
        """From a config whose heads folder holds ``num_heads`` heads (options.BlockwiseOptions checked the rest);
        every mistake is a ValueError that says what to change."""
        opts = cfg.options(BlockwiseOptions)
        k = cfg.num_speculative_tokens if cfg.num_speculative_tokens is not None else num_heads
        if not isinstance(k, int) or not 1 <= k <= num_heads:
            raise ValueError(
                f"blockwise num_speculative_tokens must be an integer in [1, {num_heads}] (the heads folder has "
                f"{num_heads} heads, one per offset 1..{num_heads}), got {k!r}; train more heads with "
                "`leapdecode train blockwise`"
            )
        if opts.acceptance == "exact":
            return cls(k)
        min_block = opts.min_block or 0
        if min_block > k:
            raise ValueError(f"blockwise min_block must be an integer in [0, k={k}] (proposed tokens kept without "
                             f"the top-k test), got {min_block!r}")
        return cls(k, opts.acceptance, opts.top_k if opts.top_k is not None else DEFAULT_TOP_K, min_block)


class BlockwiseProposer(HeadsProposer):
    """Chains of the block heads' top-1 tokens. Keeps each sequence's last observed hidden state (the text of its
    block is the sequence's own tokens) and, for sizing, the chain's acceptance by position over every
    verification it drafted."""

    name = "blockwise"

    def __init__(
        self,
        heads: BlockHeads,
        lm_weight: torch.Tensor,
        vocab_subset: torch.Tensor | None,
        settings: BlockwiseSettings,
        target: LlamaForCausalLM,
        chain_prior: list[float] | None = None,
    ) -> None:
        if settings.k > heads.num_heads:
            raise ValueError(f"k={settings.k} needs {settings.k} heads, the folder has {heads.num_heads}")
        super().__init__(heads, lm_weight, vocab_subset)  # type: ignore[arg-type]  # any heads module
        self.block_heads: BlockHeads = self.heads  # type: ignore[assignment]
        self.settings = settings
        self.embed = target.embed  # the target's input embeddings: the keys of the heads' attention
        self.fixed_budget = settings.lossy  # the lossy mode's block never depends on the machine's timing
        # per draft position i: [verified, accepted] (accepted given the drafts before it were), seeded with the
        # held-out chain acceptance as PRIOR_WEIGHT verifications
        prior = chain_prior or [FALLBACK_ACCEPTANCE ** (i + 1) for i in range(heads.num_heads)]
        cond = [prior[0]] + [prior[i] / max(prior[i - 1], 1e-6) for i in range(1, len(prior))]
        self.position_counts = [[PRIOR_WEIGHT, PRIOR_WEIGHT * min(max(c, 0.0), 1.0)] for c in cond]
        self._heads_cost: dict[int, float] = {}

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, view: EngineView, heads_dir: str | None = None,
                    settings: Callable[[int], BlockwiseSettings] | None = None) -> BlockwiseProposer:
        """The heads in ``heads_dir`` (default: the config's "model", else the shipped ones) with ``settings`` for
        their number of heads (default: the config's)."""
        folder = Path(heads_dir or cfg.model or BLOCKWISE_DIR)
        heads, subset, meta = load_block_heads(folder)
        weight = check_heads_fit(folder, heads, meta, view.model, kind="blockwise")
        resolve = settings or (lambda n: BlockwiseSettings.from_config(cfg, n))
        prior = meta.get("validation", {}).get("chain_acceptance")
        proposer = cls(heads, weight, subset, resolve(heads.num_heads), view.model, prior)
        proposer.pack_readout(view)
        return proposer

    # ---------------------------------------------------------------------------------------------- sizing
    def expected_tokens(self, n: int) -> float:
        """Tokens per target step with n drafts: 1 + sum over i <= n of P(the first i drafts all accepted)."""
        total, chain = 1.0, 1.0
        for verified, accepted in self.position_counts[:n]:
            chain *= accepted / verified
            total += chain
        return total

    def best_block(self, cost: StepCost, batch: int) -> int:
        """argmax_n of batch * E(n) / (t(batch * (1 + n)) + heads time), against plain ``batch / t(batch)``:
        0 when no block size beats plain decoding."""
        best, best_rate = 0, batch / max(cost(batch), 1e-9)
        head_t = self.heads_cost(batch)
        for n in range(1, self.settings.k + 1):
            rate = batch * self.expected_tokens(n) / (cost(batch * (1 + n)) + head_t)
            if rate > best_rate * 1.02:
                best, best_rate = n, rate
        return best

    def tree_budget(self, seq: Sequence, room: int, cost: StepCost | None, batch: int) -> tuple[int, float]:
        """Top-k mode, or no cost model: the full block. Exact mode: the cost model's best block size (module
        docstring). Trimmed to ``room``."""
        n = self.settings.k if self.fixed_budget or cost is None else self.best_block(cost, batch)
        n = max(0, min(n, room))
        return n, self.expected_tokens(n)

    def step_cost(self, num_seqs: int, num_tokens: int) -> float:
        """The heads' own time per step (one pass proposes the whole block)."""
        return self.heads_cost(num_seqs) if num_tokens > 0 else 0.0

    def heads_cost(self, batch: int) -> float:
        """Measured seconds for the heads and their read-out on ``batch`` sequences (median of 3)."""
        if batch not in self._heads_cost:
            d, L = self.block_heads.hidden_size, self.block_heads.context_len
            h = torch.zeros(batch, d, dtype=self.lm_weight.dtype, device=self.lm_weight.device)
            ids = torch.zeros(batch, L, dtype=torch.long, device=self.lm_weight.device)
            valid = torch.ones(batch, L, dtype=torch.bool, device=self.lm_weight.device)
            ts = []
            for _ in range(4):
                t0 = time.perf_counter()
                self.block(h, ids, valid, self.settings.k)
                ts.append(time.perf_counter() - t0)
            self._heads_cost[batch] = rank0_value(sorted(ts[1:])[1])  # one decision on every tensor-parallel rank
        return self._heads_cost[batch]

    def on_verified(self, seq: Sequence, result: Verification) -> None:
        """Count the chain's acceptance by position: drafts 0..m-1 accepted, draft m (if any) rejected."""
        m = result.num_accepted
        for i in range(min(len(result.drafts), m + 1)):
            self.position_counts[i][0] += 1.0
            self.position_counts[i][1] += 1.0 if i < m else 0.0

    # ---------------------------------------------------------------------------------------------- predict
    @torch.inference_mode()
    def block(self, h: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
        """[B, d] hidden states, [B, L] the sequences' last tokens (``valid`` False for padding) -> [B, k] the
        first k slots' top-1 tokens."""
        dt = self.lm_weight.dtype
        emb = self.embed(ids.reshape(-1)).view(*ids.shape, -1).to(dt)
        z = self.block_heads(h.to(dt), emb, valid, range(k))  # [B, k, d]
        top = self.readout(z).argmax(dim=-1)
        return top if self.subset is None else self.subset[top]

    def context(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """The last L tokens of each sequence, oldest first, left-padded: ids [B, L] and valid [B, L]."""
        L = self.block_heads.context_len
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        valid = torch.zeros(len(seqs), L, dtype=torch.bool)
        for i, seq in enumerate(seqs):
            tail = seq.token_ids[-L:]
            ids[i, L - len(tail):] = torch.tensor(tail, dtype=torch.long)
            valid[i, L - len(tail):] = True
        dev = self.lm_weight.device
        return ids.to(dev), valid.to(dev)

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        props = [Proposal([]) for _ in seqs]
        rows, hidden = self.fresh_hidden(seqs, budgets)
        if hidden is None:
            return props
        width = max(budgets[i] for i in rows)
        ids, valid = self.context([seqs[i] for i in rows])
        toks = self.block(hidden, ids, valid, width).tolist()
        for i, t in zip(rows, toks):
            props[i] = Proposal(t[: budgets[i]])
        return props

    # ----------------------------------------------------------------------------------------------- accept
    def verify_chain(
        self, seq: Sequence, drafts: list[int], logits: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[list[int], int] | None:
        """Exact greedy: ``None`` (the engine's greedy match). Exact sampled: the chain walk (module docstring).
        Top-k: :func:`verify_block_topk`, counting its non-top-choice tokens in the request's metrics."""
        s = self.settings
        if s.lossy:
            tokens, accepted, lossy = verify_block_topk(logits, drafts, seq.params, generator, s.top_k, s.min_block)
            seq.metrics.num_lossy_tokens += lossy
            return tokens, accepted
        if seq.params.greedy:
            return None
        p = processed_probs(logits, [seq.params] * logits.shape[0])
        tokens, path = verify_tree_sampling(p, drafts, list(range(-1, len(drafts) - 1)), generator)
        return tokens, len(path)


def lossy_blockwise(opts: AutoOptions, num_heads: int) -> BlockwiseSettings:
    """The settings of auto's lossy branch for heads of ``num_heads`` offsets: top-k acceptance (block-parallel
    decoding), and under an extreme latency target every proposed token kept (``min_block`` = the block:
    non-autoregressive blocks, the verification pass only adds the next token)."""
    return BlockwiseSettings(num_heads, "topk", DEFAULT_TOP_K, num_heads if extreme_latency(opts) else 0)


def _build(cfg: SpeculativeConfig, view: EngineView, auto: bool) -> BlockwiseProposer:
    """The config's heads and settings; under auto (its lossy branch only) the shipped heads, with the router's
    lossy settings."""
    if not auto:
        return BlockwiseProposer.from_config(cfg, view)
    opts = cfg.options(AutoOptions)
    return BlockwiseProposer.from_config(cfg, view, str(BLOCKWISE_DIR), lambda n: lossy_blockwise(opts, n))


METHOD = Method(
    name="blockwise",
    options=(BlockwiseOptions,),
    shared=frozenset({"model", "num_speculative_tokens", "use_cost_model"}),
    build=_build,
    artifact="blockwise",
    auto=AutoUse("lossy", rank=0, usable=lambda cfg, target: target is not None and
                 shipped_heads_for(target, BLOCKWISE_DIR, BLOCK_HEADS_TYPE) is not None),
    lossy_bench={"blockwise_topk": {"method": "blockwise", "acceptance": "topk", "top_k": 2}},
)

__all__ = ["ACCEPTANCE", "METHOD", "BlockwiseOptions", "BlockwiseProposer", "BlockwiseSettings", "lossy_blockwise"]

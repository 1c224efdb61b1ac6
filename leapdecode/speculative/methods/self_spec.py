"""Self-speculation: draft with the target's own first L layers plus a trained exit adapter (Kangaroo-style).

The drafter is ``LMHead(norm(adapter(h_L)))``: ``h_L`` is the target's residual stream after its first ``L``
layers, the adapter is one decoder layer plus an RMSNorm trained to map it to the target's next-token
distribution (``leapdecode train self-spec``), and the LM head is the target's own (tied), so there is no second
model to load or keep in step with the tokenizer.

What is shared, and why nothing is computed twice for committed tokens:

- **Layers [0, L)** run *in the target's own KV cache*. A draft step feeds one token per sequence (the last
  committed token, then each draft) at its real position, so its layer-[0, L) K/V land in the target's slots
  beyond the committed length. The verification pass recomputes every layer for those positions anyway and
  overwrites them; for accepted tokens it writes exactly what the draft wrote (same inputs), so the drafter
  never has to recompute the shared layers for tokens it has already drafted and never runs them over a prompt.
- **h_L for committed tokens** comes from the target: the engine's runner hands every full pass's layer-L
  residual stream to :meth:`SelfSpecProposer._capture` (``ModelRunner.add_capture``), which files it by KV slot in
  ``h_pool`` (one hidden vector per target slot, ~5% of a float KV cache) with the position and token id it
  belongs to. A prompt, or the last draft of a fully accepted chain (which the drafter never fed), is caught up
  by running *only the adapter* on those stored rows.
- **The adapter's K/V** is the only state the drafter owns: a paged cache of its layers with its own block
  tables (``adapter_bm``), rolled back to the committed prefix after each verification (``on_verified``) and freed
  when the request ends (``release``).

Counters (``num_shared_tokens`` = rows the drafter put through layers [0, L), ``num_adapter_tokens``,
``num_catchup_tokens``, ``num_fallback_tokens``) make "never recomputes the shared layers for accepted tokens"
testable: per drafted chain of k tokens the drafter runs exactly k rows through the shared layers.

When a tree's accepted nodes are compacted into sequential slots, ``h_pool`` follows the K/V
(``ModelRunner.copy_slots`` calls ``_copy_slots``). The fallback: when a stored ``h_L`` still does not carry the
expected (position, token) tag (another pass overwrote the slot), the drafter recomputes the shared layers for
those committed positions, reading the target's committed K/V but writing its own K/V to a scratch slot beyond
the committed length, so the target's cache for committed tokens is never touched.

Drafting stops early when the draft's top probability falls below ``min_draft_prob`` (speculative config key,
default from the artifact, else 0.3): a low-confidence draft is rarely accepted and costs a verification row.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ForwardItem, ModelRunner
from leapdecode.engine.sequence import Sequence
from leapdecode.layers import small_gemm
from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.speculative.artifacts import (
    TRAIN_COMMANDS,
    load_adapter,
    shipped_adapter_for,
    shipped_adapter_path,
    shipped_dir,
)
from leapdecode.speculative.exit_adapter import ExitAdapter
from leapdecode.speculative.method import AutoUse, Method
from leapdecode.speculative.options import CHAIN_KEYS, DRAFT_PRECISIONS, DrafterOptions, DraftPrecision
from leapdecode.speculative.proposer import EngineView, tensor_bytes
from leapdecode.speculative.shadow_cache import DraftLogits, Plan, Shadow, ShadowCacheProposer

DEFAULT_MIN_DRAFT_PROB = 0.3
ARTIFACT = "self_spec"  # the shipped exit adapter: leapdecode/artifacts/self_spec/


@dataclasses.dataclass(frozen=True)
class LoadedDrafter:
    """A trained adapter drafter as its artifact and the config settle it (``load_drafter``)."""

    path: Path
    adapter: ExitAdapter
    min_draft_prob: float
    vocab_subset: torch.Tensor | None
    prior_acceptance: float | None


def load_drafter(cfg: SpeculativeConfig, target: LlamaForCausalLM, kind: str, shipped_only: bool) -> LoadedDrafter:
    """The adapter drafter of ``kind`` for ``cfg``: the folder "model" names, or (without one, or with
    ``shipped_only``, as under ``auto``, where "model" names a draft model) the shipped one, which must have been
    trained for ``target``. Settles the stop threshold, the vocabulary subset and the measured acceptance from the
    artifact and the config's drafter options."""
    user_path = None if shipped_only else cfg.model
    folder, command = shipped_dir(kind), TRAIN_COMMANDS[kind]
    path = Path(user_path) if user_path else shipped_adapter_path(folder)
    if path is None:
        raise ValueError(
            f'speculative method "{kind}" needs a trained drafter: pass "model": PATH (a folder written by '
            f"{command}); none is shipped in {folder}"
        )
    if user_path is None and shipped_adapter_for(target, folder) is None:
        raise ValueError(f'speculative method "{kind}" needs "model": PATH for this model: the shipped drafter '
                         f"({path}) was trained for another one ({command} makes one)")
    adapter, acfg, ranked = load_adapter(path, target)
    if kind == "eagle" and not adapter.feature_input:
        raise ValueError(f'speculative method "eagle" needs a feature-conditioned draft ({command}); '
                         f"{path} reads {'h_L' if adapter.layer_index else 'tokens only'}")
    if kind != "eagle" and adapter.feature_input:
        raise ValueError(f'{path} is a feature-conditioned draft: run it with the "eagle" method, not "{kind}"')
    opts = cfg.options(DrafterOptions)
    min_p = float(opts.min_draft_prob if opts.min_draft_prob is not None
                  else acfg.get("min_draft_prob", DEFAULT_MIN_DRAFT_PROB))
    draft_vocab = int(opts.draft_vocab if opts.draft_vocab is not None else acfg.get("draft_vocab", 0) or 0)
    subset = None
    if draft_vocab:
        if ranked is None:
            raise ValueError(f"draft_vocab={draft_vocab} needs a ranked vocabulary, and {path} has none")
        subset = ranked[:draft_vocab]
    return LoadedDrafter(path, adapter, min_p, subset, _measured_acceptance(acfg, min_p, subset, draft_vocab))


def _measured_acceptance(acfg: dict[str, Any], min_p: float, subset: torch.Tensor | None,
                         draft_vocab: int) -> float | None:
    """The artifact's held-out agreement that matches how it will draft: drafting stops below min_draft_prob, so
    a drafted token's acceptance is the agreement where the draft is that confident (valid when the threshold
    is the one the artifact was validated at); a vocabulary subset was validated only for the training loss's
    subset (it can agree more: no rare tokens)."""
    val = acfg.get("validation") or {}
    key = "agree_confident" if min_p == float(acfg.get("min_draft_prob", -1)) and min_p > 0 else "agree"
    if subset is not None:
        key = "agree_subset_head" if draft_vocab == acfg.get("loss_vocab") else ""
    v = val.get(key)
    return float(v) if isinstance(v, (int, float)) else None


class SelfSpecProposer(ShadowCacheProposer):
    """Drafts with target layers [0, L) (writing the target's own cache slots beyond the committed length), the
    exit adapter (its own paged cache) and the target's LM head. See the module docstring."""

    name = "self_spec"

    def __init__(self, view: EngineView, adapter: ExitAdapter, min_draft_prob: float = DEFAULT_MIN_DRAFT_PROB,
                 vocab_subset: torch.Tensor | None = None, draft_precision: DraftPrecision = "int8") -> None:
        self.view = view
        self.model: LlamaForCausalLM = view.model
        self.generator = view.generator
        self.max_model_len = view.max_model_len
        self.vocab_size = view.model.config.vocab_size
        self.adapter = adapter
        self.num_shared_layers = adapter.layer_index
        self.min_draft_prob = float(min_draft_prob)
        cfg = self.model.config
        bs = view.block_size
        num_blocks = view.block_manager.num_blocks
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.target_runner: ModelRunner = view.runner
        self.target_kv: KVCache = view.kv_cache
        # the adapter's own paged cache (its layers only); as many blocks as the target, which is enough for every
        # running sequence (adapter positions never exceed the target's)
        adapter_cfg = dataclasses.replace(cfg, num_hidden_layers=adapter.num_layers)
        self.adapter_kv = KVCache(adapter_cfg, num_blocks, bs, self.dtype, self.device)
        self.adapter_bm = self.shadow_bm = BlockManager(num_blocks, bs, enable_prefix_caching=False)
        self.adapter_runner = ModelRunner(self.model, self.adapter_kv, bs, self.device)  # for prepare() only
        self.shadows: dict[str, Shadow] = {}
        # h_L of every target pass, filed by target KV slot, with the (position, token) each row belongs to
        slots = num_blocks * bs
        self.h_pool = torch.zeros(slots, cfg.hidden_size, dtype=self.dtype, device=self.device)
        self.pos_tag = torch.full((slots,), -1, dtype=torch.long, device=self.device)
        self.tok_tag = torch.full((slots,), -1, dtype=torch.long, device=self.device)
        self.target_runner.add_capture(self.capture_layer(), self._capture, self._copy_slots)
        self.vocab_subset = None if vocab_subset is None else vocab_subset.to(self.device, torch.long)
        self._head_subset: torch.Tensor | None = None
        self._head_subset_packed: torch.Tensor | None = None
        if self.vocab_subset is not None:
            self._head_subset = self.model.lm_head.get_weight().index_select(0, self.vocab_subset)
        # the adapter and a subset head through the engine's few-row kernel, as the target's own layers: unpacked,
        # the adapter alone read 14 MB of float32 weights per draft step through torch's ops. "int8" (default on
        # a CPU): Q8_0 weights and int8 activations, a quarter of the bytes on VNNI or AVX2 (kernel_plan.
        # use_int8_drafting); the target verifies every token, so precision moves acceptance, not output
        if draft_precision not in DRAFT_PRECISIONS:  # checked by DrafterOptions too; this guards direct callers
            raise ValueError(f"draft_precision must be one of {DRAFT_PRECISIONS}, got {draft_precision!r}")
        packed = view.pack_linears(adapter, quantize_q8=draft_precision == "int8")
        # int8 only where the engine packs at all (a CPU float32 model with the kernel); else the weights stay float
        int8 = bool(getattr(adapter, "int8_activations", False))
        if packed and self._head_subset is not None:
            self._head_subset_packed = small_gemm.pack_rows(self.model.lm_head, self.vocab_subset, self._head_subset,
                                                            int8_activations=int8)
        self.draft_precision = "int8" if int8 else "float32"
        # counters (see the module docstring)
        self.num_shared_tokens = 0
        self.num_shared_calls = 0
        self.num_adapter_tokens = 0
        self.num_catchup_tokens = 0
        self.num_fallback_tokens = 0
        self.num_captured_tokens = 0

    def memory_bytes(self) -> int:
        """The adapter's weights, its KV cache, the captured hidden states with their tags, a subset head."""
        return (tensor_bytes(self.adapter, self.h_pool, self.pos_tag, self.tok_tag, self._head_subset,
                             self._head_subset_packed) + self.adapter_kv.nbytes)

    def capture_layer(self) -> int:
        """After which target layer the runner hands this drafter its hidden states (h_L)."""
        return self.num_shared_layers

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, view: EngineView, kind: str = "self_spec",
                    shipped_only: bool = False) -> SelfSpecProposer:
        """The drafter ``load_drafter`` finds for ``kind`` ("self_spec": the exit adapter; "draft_model": a trained
        small draft, an adapter with no shared layers), with the config's drafter options (options.DrafterOptions)."""
        d = load_drafter(cfg, view.model, kind, shipped_only)
        prop = cls(view, d.adapter, d.min_draft_prob, d.vocab_subset, cfg.options(DrafterOptions).draft_precision)
        prop.name = kind
        prop.prior_acceptance = d.prior_acceptance
        return prop

    def detach(self) -> None:
        """Stop capturing the target's hidden states (``auto`` dropped this drafter); frees the hidden pool."""
        self.target_runner.remove_capture(self._capture)
        self.h_pool = self.h_pool.new_zeros(0, self.h_pool.shape[1])

    # ------------------------------------------------------------------------------------ target capture
    def _capture(self, h: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Called by the target's runner after layer L-1 of every full pass: keep h_L by slot, tagged."""
        self.h_pool.index_copy_(0, slot_mapping, h.to(self.dtype))
        self.pos_tag.index_copy_(0, slot_mapping, positions)
        self.tok_tag.index_copy_(0, slot_mapping, input_ids)
        self.num_captured_tokens += int(h.shape[0])

    def _copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The engine moved K/V (tree compaction): the hidden states and tags filed at those slots move along."""
        if self.h_pool.shape[0]:
            for t in (self.h_pool, self.pos_tag, self.tok_tag):
                t.index_copy_(0, dst, t.index_select(0, src))

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.view.block_size
        p = torch.arange(start, end)
        return (torch.tensor(table, dtype=torch.long)[p // bs] * bs + p % bs).to(self.device)

    def _catchup_rows(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """h_L of committed positions [start, end) from the target's passes; positions whose tag does not match
        (a tree method moved their K/V) are recomputed from the first mismatch on (the fallback)."""
        if end <= start:
            return self.h_pool.new_zeros(0, self.h_pool.shape[1])
        slots = self._slots(seq.block_table, start, end)
        want_pos = torch.arange(start, end, device=self.device)
        want_tok = torch.tensor(seq.token_ids[start:end], dtype=torch.long, device=self.device)
        ok = (self.pos_tag[slots] == want_pos) & (self.tok_tag[slots] == want_tok)
        rows = self.h_pool[slots]
        if bool(ok.all()):
            return rows
        first = int((~ok).nonzero()[0, 0])
        fresh = self._recompute_shared(seq, start + first, end)
        return torch.cat([rows[:first], fresh])

    # -------------------------------------------------------------------------------------------- passes
    def _shared(self, items: list[ForwardItem], scratch_slot: int | None = None) -> torch.Tensor:
        """Target layers [0, L) over ``items`` (flat rows, un-normed h_L). K/V go to the items' slots in the
        target cache, or all to ``scratch_slot`` when given (the fallback must not rewrite committed K/V)."""
        ids, pos, meta, _ = self.target_runner.prepare(items)
        if scratch_slot is not None:
            meta.slot_mapping = torch.full_like(meta.slot_mapping, scratch_slot)
        h = self.model(ids, pos, self.target_kv.layers, meta, layers=range(self.num_shared_layers),
                       final_norm=False)
        self.num_shared_calls += 1
        self.num_shared_tokens += int(ids.numel())
        return h

    def _adapter_pass(self, items: list[ForwardItem], h: torch.Tensor) -> torch.Tensor:
        """The adapter over flat rows ``h`` laid out as ``items`` (adapter block tables); returns the normed
        hidden states of the items' ``logit_rows``."""
        _, pos, meta, rows = self.adapter_runner.prepare(items)
        rope = self.model.rope.table(pos, h.dtype)
        out = self.adapter(h, rope, self.adapter_kv.layers, meta)
        self.num_adapter_tokens += int(h.shape[0])
        return out.index_select(0, rows)

    def _subset_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float logits over the vocabulary subset and the token ids of its columns (None: the full vocabulary,
        ids = columns). Only the subset's rows of the LM head are scored; the other tokens are never drafted, and
        softmax, max and top-k over these columns equal those over a full width with -inf elsewhere."""
        if self._head_subset is None:
            return self.model.compute_logits(hidden).float(), None
        return small_gemm.linear(hidden, self._head_subset, None, self._head_subset_packed).float(), self.vocab_subset

    def _recompute_shared(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Fallback: h_L for committed positions [start, end) by running layers [0, L); attention reads the
        target's committed K/V, and this pass's own K/V go to the slot of position ``num_tokens - 1`` (not yet
        computed, written again by the draft pass and the verification)."""
        scratch = int(self._slots(seq.block_table, seq.num_tokens - 1, seq.num_tokens)[0])
        h = self._shared([ForwardItem(seq.block_table, start, seq.token_ids[start:end], [])], scratch_slot=scratch)
        self.num_fallback_tokens += end - start
        return h

    # ------------------------------------------------------------------------------------------ proposing
    def _catchup_for(self, seq: Sequence, start: int) -> torch.Tensor:
        """What the adapter must see of committed positions [start, n-1) before it drafts: their h_L."""
        return self._catchup_rows(seq, start, seq.num_tokens - 1)

    def _draft_pass(self, active: list[Plan], fed: list[int] | None) -> tuple[list[ForwardItem], DraftLogits]:
        """Target layers [0, L) over each chain's newest token (the last committed one first, then the previous
        draft) at its real position, then the adapter: on the first pass over the catch-up rows too."""
        if fed is None:
            h_new = self._shared([ForwardItem(p.seq.block_table, p.seq.num_tokens - 1, [p.seq.token_ids[-1]], [0])
                                  for p in active])
            parts: list[torch.Tensor] = []
            items: list[ForwardItem] = []
            for j, p in enumerate(active):
                assert p.catchup is not None
                m = p.catchup.shape[0]
                self.num_catchup_tokens += m
                parts += [p.catchup, h_new[j : j + 1]]
                items.append(ForwardItem(p.shadow.block_table, p.shadow.num_computed_tokens, [0] * (m + 1), [m]))
            h_in = torch.cat(parts)
        else:  # after the first pass the adapter cache ends where the target's next draft position is
            h_in = self._shared([ForwardItem(p.seq.block_table, p.shadow.num_computed_tokens, [tok], [0])
                                 for p, tok in zip(active, fed)])
            items = [ForwardItem(p.shadow.block_table, p.shadow.num_computed_tokens, [0], [0]) for p in active]
        return items, self._subset_logits(self._adapter_pass(items, h_in))

    # on_verified / release (ShadowCacheProposer) roll the adapter cache back to the committed prefix; accepted
    # drafts keep the adapter K/V written while drafting (their h_L equals the target's): nothing is recomputed

    # ------------------------------------------------------------------------------------------------ cost
    @torch.inference_mode()
    def timed_draft_step(self, n: int) -> None:
        """One draft step of ``n`` rows at a short context on borrowed scratch blocks (returned), for the cost
        model; it bypasses the capture so h_pool is untouched."""
        ctx = 64
        bm, abm = self.view.block_manager, self.adapter_bm
        if any(m.blocks_needed(ctx + n) > m.num_free_blocks for m in (bm, abm)):
            return
        counters = (self.num_shared_tokens, self.num_shared_calls, self.num_adapter_tokens)
        try:
            with bm.borrowed(ctx + n) as target_table, abm.borrowed(ctx + n) as adapter_table:
                h = self._shared([ForwardItem(target_table, ctx, [0] * n, [])])
                out = self._adapter_pass([ForwardItem(adapter_table, ctx, [0] * n, list(range(n)))], h)
                torch.softmax(self._subset_logits(out)[0], dim=-1).max(dim=-1)
        finally:
            self.num_shared_tokens, self.num_shared_calls, self.num_adapter_tokens = counters


METHOD = Method(
    name="self_spec",
    options=(DrafterOptions,),
    shared=frozenset({"model"}) | CHAIN_KEYS,
    build=lambda cfg, view, auto: SelfSpecProposer.from_config(cfg, view, ARTIFACT, shipped_only=auto),
    artifact=ARTIFACT,
    auto=AutoUse("hidden", rank=2, options=(DrafterOptions,),
                 usable=lambda cfg, target: target is not None and
                 shipped_adapter_for(target, shipped_dir(ARTIFACT)) is not None),
)

__all__ = ["DEFAULT_MIN_DRAFT_PROB", "METHOD", "LoadedDrafter", "SelfSpecProposer", "load_drafter"]

"""Turns a list of per-sequence work items into one flat forward pass over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from leapdecode.engine.kv_cache import KVCache
from leapdecode.layers.attention import SMALL_QUERY, SeqAttention, build_attention_metadata
from leapdecode.models.llama import LlamaForCausalLM

CaptureFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class ForwardItem:
    """New tokens of one sequence to run through the model.

    The tokens go to cache positions ``start .. start+len(tokens)-1`` (slots from ``block_table``). Their RoPE
    positions are the same unless ``depths`` is given (a candidate tree: node i sits at ``start + depths[i]``), in
    which case ``tree_mask`` says which new tokens each may attend to ([len(tokens), m]: the last m positions,
    so a tree grown over several passes can also mask its nodes cached by earlier ones).
    """

    block_table: list[int]
    start: int
    tokens: list[int]
    logit_rows: list[int]  # local indices whose logits (and hidden states) are returned
    depths: list[int] | None = None
    tree_mask: torch.Tensor | None = None


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [len(logit_rows), vocab] float32
    hidden: torch.Tensor  # [len(logit_rows), hidden] final-norm hidden states of the same rows


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.group_size = model.config.num_attention_heads // model.config.num_key_value_heads
        self.num_forward_calls = 0
        self.num_forward_tokens = 0
        # Self-speculation (speculative/methods/self_spec.py) reads the residual stream after the first L layers
        # of every full pass, so its drafter reuses the target's own hidden states for committed tokens instead
        # of recomputing the shared layers. ``captures`` maps L -> fns called as ``fn(hidden, input_ids,
        # positions, slot_mapping)``; several drafters (auto: self_spec at L=15 and the small draft at L=0) may
        # listen. At L = the number of layers (EAGLE's features) the hidden state is the final norm's output, the
        # rows the LM head reads, so no pass computes that norm twice.
        self.captures: dict[int, list[CaptureFn]] = {}
        # what each capture keeps is filed by KV slot, so it must follow K/V that the engine copies between slots
        # (a tree's accepted nodes compacted into sequential slots): capture fn -> fn(src_slots, dst_slots)
        self.capture_copies: dict[CaptureFn, Callable[[torch.Tensor, torch.Tensor], None]] = {}
        # CUDA graphs (engine/cuda_graphs.py): runs a full pass from captured static buffers, or returns None for
        # a step that must run eagerly
        self.graph_step: Callable[[list[ForwardItem]], list[ForwardResult] | None] | None = None

    def prepare(self, items: list[ForwardItem]):
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seqs: list[SeqAttention] = []
        rows: list[int] = []
        bs = self.block_size
        for it in items:
            q_start, q_len = len(ids), len(it.tokens)
            ids += it.tokens
            table = it.block_table
            # the new tokens' cache slots, and their positions in the text (a tree's nodes sit at their depth)
            slots += [table[p // bs] * bs + p % bs for p in range(it.start, it.start + q_len)]
            if it.depths is None:
                positions += range(it.start, it.start + q_len)
                row_pos = None
            else:
                positions += [it.start + d for d in it.depths]
                row_pos = it.start + torch.tensor(it.depths, dtype=torch.long)
            seqs.append(SeqAttention(q_start, q_len, it.start + q_len, table, bs, it.tree_mask, row_pos))
            rows += [q_start + r for r in it.logit_rows]
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        # int8 activations: prompts through the rows kernel too, or a prefix-cache hit would change the output
        small_query = None if getattr(self.model, "int8_activations", False) else SMALL_QUERY
        meta = build_attention_metadata(seqs, slot_mapping, self.group_size, dev, small_query,
                                        self.model.config.attention_windows())
        return input_ids, pos, meta, torch.tensor(rows, dtype=torch.long, device=dev)

    def add_capture(self, layer: int, fn: CaptureFn,
                    on_copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        self.captures.setdefault(layer, []).append(fn)
        if on_copy is not None:
            self.capture_copies[fn] = on_copy

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V from slots ``src`` to ``dst`` (every layer and tier) and tell the captures to do the same."""
        self.kv_cache.copy_slots(src, dst)
        for on_copy in self.capture_copies.values():
            on_copy(src, dst)

    def remove_capture(self, fn: CaptureFn) -> None:
        self.capture_copies.pop(fn, None)
        for layer in list(self.captures):
            self.captures[layer] = [f for f in self.captures[layer] if f != fn]
            if not self.captures[layer]:
                del self.captures[layer]

    @torch.inference_mode()
    def execute(self, items: list[ForwardItem], layers: range | None = None) -> list[ForwardResult]:
        if self.graph_step is not None and layers is None and not self.captures:
            replayed = self.graph_step(items)
            if replayed is not None:
                self.num_forward_calls += 1
                self.num_forward_tokens += sum(len(it.tokens) for it in items)
                return replayed
        input_ids, pos, meta, rows = self.prepare(items)
        kv = self.kv_cache.layers
        if self.captures and layers is None:  # the full pass in segments, handing each cut's hidden state out
            num_layers = len(self.model.layers)
            h, start = None, 0
            for cut in sorted(c for c in self.captures if c < num_layers):
                if cut == start:  # nothing to run before this cut: the embeddings, or the last cut's output
                    h = self.model.embed(input_ids) if h is None else h
                else:
                    h = self.model(input_ids, pos, kv, meta, layers=range(start, cut), hidden=h, final_norm=False)
                for fn in self.captures[cut]:
                    fn(h, input_ids, pos, meta.slot_mapping)
                start = cut
            hidden = self.model(input_ids, pos, kv, meta, layers=range(start, num_layers), hidden=h)
            for fn in self.captures.get(num_layers, ()):  # after the last layer: the normed output the head reads
                fn(hidden, input_ids, pos, meta.slot_mapping)
        else:
            hidden = self.model(input_ids, pos, kv, meta, layers=layers)
        self.num_forward_calls += 1
        self.num_forward_tokens += int(input_ids.numel())
        sel = hidden.index_select(0, rows) if rows.numel() != hidden.shape[0] else hidden
        logits = self.model.compute_logits(sel).float() if rows.numel() else sel.new_zeros(0, 0)
        out: list[ForwardResult] = []
        i = 0
        for it in items:
            n = len(it.logit_rows)
            out.append(ForwardResult(logits[i : i + n], sel[i : i + n]))
            i += n
        return out

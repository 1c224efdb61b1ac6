"""A separate, smaller draft model with the target's tokenizer, run through its own paged KV cache.

The draft may run at a lower precision than the target (``draft_linear_kernel``, e.g. int8 activations): the
target still verifies every token, so the output stays the target's; precision only moves acceptance.

The draft keeps a shadow of every target sequence: its own block table and how many leading tokens it has K/V
for. Each step it first *catches up* (feeds the committed tokens it has not seen, usually the bonus token plus the
last accepted draft, or a whole prompt for a new sequence) and then drafts autoregressively, all sequences of the
batch in one forward per draft position. After verification it rolls its shadow back to the committed prefix.

``{"method": "draft_model"}`` without a path, or with a folder written by ``leapdecode train draft-model``, runs a
*trained* small draft instead: an exit adapter with no shared target layers (methods/self_spec.py), which reuses
the target's embedding and LM head and needs no second checkpoint (``make_draft_model``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ForwardItem, ModelRunner
from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.models.loader import load_model, resolve_model
from leapdecode.models.tokenizer import load_tokenizer
from leapdecode.speculative.artifacts import is_adapter_folder, shipped_adapter_for, shipped_dir
from leapdecode.speculative.method import AutoUse, Method
from leapdecode.speculative.methods.self_spec import SelfSpecProposer
from leapdecode.speculative.options import CHAIN_KEYS, DrafterOptions
from leapdecode.speculative.policy import scratch_step
from leapdecode.speculative.proposer import EngineView, tensor_bytes
from leapdecode.speculative.shadow_cache import DraftLogits, Plan, Shadow, ShadowCacheProposer


def check_same_tokenizer(target_tok, draft_tok) -> None:
    if target_tok is None or draft_tok is None:
        return
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    shared = [t for t in tv if t in dv]
    mismatched = sum(tv[t] != dv[t] for t in shared)
    if len(shared) < 0.99 * len(tv) or mismatched:
        raise ValueError(
            "the draft model's tokenizer differs from the target's "
            f"({len(tv) - len(shared)} target tokens missing, {mismatched} with other ids); "
            "speculative decoding needs a draft with the same tokenizer"
        )


class DraftModelProposer(ShadowCacheProposer):
    name = "draft_model"

    def __init__(self, model: torch.nn.Module, vocab_size: int, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, max_model_len: int, generator: torch.Generator) -> None:
        self.model = model
        self.generator = generator  # the engine's, for unseeded sampled requests
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv = KVCache(model.config, num_blocks, block_size, dtype, device)
        self.bm = self.shadow_bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.kv, block_size, device)
        self.shadows: dict[str, Shadow] = {}

    @classmethod
    def from_path(cls, path: str, view: EngineView, linear_kernel: str | None = None) -> DraftModelProposer:
        """Load the draft from ``path`` (``"target"``: the target's own checkpoint, loaded a second time, which
        with ``linear_kernel="packed-int8act"`` is a low-precision copy of the target as its drafter)."""
        if path == "target" and view.model_path is None:
            raise ValueError('"model": "target" needs an engine loaded from a checkpoint path')
        p = Path(view.model_path) if path == "target" else resolve_model(path)
        model, _ = load_model(p, view.dtype, view.device)
        view.pack_linears(model, linear_kernel)
        check_same_tokenizer(view.tokenizer, load_tokenizer(p) if view.tokenizer is not None else None)
        return cls(model, view.model.config.vocab_size, view.block_manager.num_blocks, view.block_size, view.device,
                   view.dtype, view.max_model_len, view.generator)

    def memory_bytes(self) -> int:
        """The draft model's weights and its own KV cache."""
        return tensor_bytes(self.model) + self.kv.nbytes

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        v = self.vocab_size
        if logits.shape[-1] == v:
            return logits
        if logits.shape[-1] > v:  # padded draft vocabulary
            return logits[..., :v]
        pad = logits.new_full((*logits.shape[:-1], v - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def _draft_pass(self, active: list[Plan], fed: list[int] | None) -> tuple[list[ForwardItem], DraftLogits]:
        """The draft model over each chain's new tokens: first every committed token it has not seen (usually the
        bonus token and the last accepted draft, or a whole prompt), then the previous draft."""
        if fed is None:
            items = []
            for p in active:
                start = p.shadow.num_computed_tokens
                new = p.seq.token_ids[start:]
                items.append(ForwardItem(p.shadow.block_table, start, new, [len(new) - 1]))
        else:
            items = [ForwardItem(p.shadow.block_table, p.shadow.num_computed_tokens, [tok], [0])
                     for p, tok in zip(active, fed)]
        results = self.runner.execute(items)
        return items, (self._fit_vocab(torch.cat([res.logits[-1:] for res in results])), None)

    def timed_draft_step(self, n: int) -> None:
        """One draft forward of ``n`` rows at a short context on borrowed blocks."""
        scratch_step(self.runner, self.bm, n)


def make_draft_model(cfg: SpeculativeConfig, view: EngineView) -> ShadowCacheProposer:
    """``{"method": "draft_model"}``: a trained small draft (no "model", or a ``leapdecode train draft-model`` folder),
    else the checkpoint "model" names (HF folder, GGUF file, or "target")."""
    if cfg.model is None or is_adapter_folder(cfg.model):
        return SelfSpecProposer.from_config(cfg, view, kind="draft_model")
    return DraftModelProposer.from_path(cfg.model, view, cfg.draft_linear_kernel)


NAME = "draft_model"


def _usable(cfg: SpeculativeConfig, target: LlamaForCausalLM | None) -> bool:
    """Under auto: a draft model named by "model", or the shipped small draft when it was trained for ``target``."""
    return bool(cfg.model) or (target is not None and shipped_adapter_for(target, shipped_dir(NAME)) is not None)


METHOD = Method(
    name=NAME,
    options=(DrafterOptions,),
    shared=frozenset({"model", "draft_linear_kernel"}) | CHAIN_KEYS,
    build=lambda cfg, view, auto: make_draft_model(cfg, view),
    artifact=NAME,
    auto=AutoUse("separate", rank=0, options=(DrafterOptions,), usable=_usable),
)

__all__ = ["METHOD", "DraftModelProposer", "check_same_tokenizer", "make_draft_model"]

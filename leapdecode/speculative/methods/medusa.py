"""Medusa: trained heads on the target's last hidden state propose a candidate tree per step (Cai et al. 2024).

The heads (heads.py) each guess the token at one offset after the next; their ranked candidates per depth are
arranged into a tree of rank paths (tree.py), shaped by the paths measured on held-out data when the heads were
trained (``tree`` in the artifact's config.json). The engine hands the proposer the final hidden state of the
position whose logits produced the last emitted token (``observe``); the next step proposes the tree, verified in
one target pass. The number of tree nodes is chosen from the engine's measured step-cost model and that
expected-tokens curve, or fixed with ``tree_nodes`` (options.MedusaOptions).

The package ships trained heads for the bundled SmolLM2-135M-Instruct in ``leapdecode/artifacts/medusa/``
(artifacts.py: the artifact format).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.sequence import Sequence
from leapdecode.parallel import rank0_value
from leapdecode.speculative import tree as T
from leapdecode.speculative.artifacts import MEDUSA_DIR, check_heads_fit, load_heads, shipped_heads_for
from leapdecode.speculative.heads import HeadsProposer, MedusaHeads, ranked_candidates
from leapdecode.speculative.method import AutoUse, Method
from leapdecode.speculative.options import check, is_int, is_prob
from leapdecode.speculative.proposer import EngineView, Proposal, StepCost

DEFAULT_TOP_K = 10  # candidates per depth the tree may draw from (options.MedusaOptions.top_k)
FALLBACK_NODES = 8  # tree size when neither statistics nor a cost model say otherwise


@dataclass(frozen=True)
class MedusaOptions:
    """Medusa trees (methods/medusa.py): ``tree_nodes`` fixes the tree size (None: sized by the step-cost model or
    the artifact); ``top_k`` candidates per depth the tree may draw from; ``typical_acceptance`` (lossy, sampled
    requests only) with its bar ``min(posterior_threshold, posterior_alpha * exp(-H(p)))``."""

    tree_nodes: int | None = None
    top_k: int = DEFAULT_TOP_K
    typical_acceptance: bool = False
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self) -> None:
        check(self.tree_nodes is None or is_int(self.tree_nodes, 0),
               f"tree_nodes must be an integer >= 0, got {self.tree_nodes!r}")
        check(is_int(self.top_k, 1), f"top_k must be an integer >= 1, got {self.top_k!r}")
        check(isinstance(self.typical_acceptance, bool),
               f"typical_acceptance must be true or false, got {self.typical_acceptance!r}")
        for key in ("posterior_threshold", "posterior_alpha"):
            check(is_prob(getattr(self, key)), f"{key} must be a number in [0, 1], got {getattr(self, key)!r}")


class MedusaProposer(HeadsProposer):
    """Tree proposals from the heads. Stateless apart from each sequence's last observed hidden state."""

    name = "medusa"

    def __init__(
        self,
        heads: MedusaHeads,
        lm_weight: torch.Tensor,
        vocab_subset: torch.Tensor | None = None,
        paths: Seq[Seq[int]] | None = None,
        curve: Seq[float] | None = None,
        tree_nodes: int | None = None,
        default_nodes: int | None = None,
        top_k: int = DEFAULT_TOP_K,
        typical: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(heads, lm_weight, vocab_subset)
        if paths is None:
            paths = T.default_paths([min(top_k, 4)] * min(heads.max_offset, 3))
        self.paths: list[tuple[int, ...]] = [tuple(p) for p in paths if len(p) <= heads.max_offset]
        self.curve = list(curve) if curve is not None else None
        self.top_k = max([top_k] + [p[-1] + 1 for p in self.paths])
        self.tree_nodes = tree_nodes
        self.default_nodes = default_nodes
        self.typical = typical
        self._best: dict[int, int] = {}
        self._heads_cost: dict[int, float] = {}

    # ----------------------------------------------------------------------------------------- loading
    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, view: EngineView, heads_dir: str | None = None,
                    opts: MedusaOptions | None = None) -> MedusaProposer:
        """``{"method": "medusa"}`` loads the shipped heads; ``"model": PATH`` (or ``heads_dir``, a hybrid's
        "heads") others; the Medusa options (``opts``, else the config's) size and verify the tree."""
        folder = Path(heads_dir or cfg.model or MEDUSA_DIR)
        heads, subset, meta = load_heads(folder)
        weight = check_heads_fit(folder, heads, meta, view.model)
        opts = opts or cfg.options(MedusaOptions)
        tree = meta.get("tree") or {}
        typical = (float(opts.posterior_threshold), float(opts.posterior_alpha)) if opts.typical_acceptance else None
        proposer = cls(heads, weight, subset, tree.get("paths"), tree.get("curve"), tree_nodes=opts.tree_nodes,
                       default_nodes=tree.get("default_nodes"), top_k=opts.top_k, typical=typical)
        proposer.pack_readout(view)
        return proposer

    def tree_acceptance(self) -> tuple[float, float] | None:
        return self.typical

    # ---------------------------------------------------------------------------------------- sizing
    def tree_budget(self, seq: Sequence, room: int, cost: StepCost | None, batch: int) -> tuple[int, float]:
        """(nodes, expected tokens per step): fixed ``tree_nodes``; else the size that maximises expected
        tokens per second under the engine's measured step cost (0 = plain decoding pays better); else the
        artifact's tuned default. Trimming to ``room`` keeps a valid tree (paths are parents-first)."""
        if self.tree_nodes is not None:
            n = self.tree_nodes
        elif cost is None or self.curve is None:
            n = self.default_nodes if self.default_nodes is not None else FALLBACK_NODES
        else:
            if batch not in self._best:
                self._best[batch] = self.best_nodes(cost, batch)
            n = self._best[batch]
        n = max(0, min(n, len(self.paths), room))
        return n, self.expected_tokens(n)

    def expected_tokens(self, nodes: int) -> float:
        """Tokens per target step with the first ``nodes`` paths, from the held-out statistics (a rough
        guess of 0.3 accepted per depth level when the heads carry none)."""
        if self.curve is not None:
            return self.curve[min(nodes, len(self.curve) - 1)]
        depth = max((len(p) for p in self.paths[:nodes]), default=0)
        return 1.0 + 0.3 * depth

    def step_cost(self, num_seqs: int, num_tokens: int) -> float:
        """The heads' own time per step (independent of the tree size: all candidates come from one pass)."""
        return self.heads_cost(num_seqs) if num_tokens > 0 else 0.0

    def best_nodes(self, cost: StepCost, batch: int) -> int:
        """argmax_N of batch * E(N) / (t(batch * (1 + N)) + heads time), against plain ``batch / t(batch)``."""
        curve = self.curve or [1.0]
        base_rate = batch / max(cost(batch), 1e-9)
        best, best_rate = 0, base_rate
        head_t = self.heads_cost(batch)
        for n in range(1, min(len(self.paths), len(curve) - 1) + 1):
            rate = batch * curve[n] / (cost(batch * (1 + n)) + head_t)
            if rate > best_rate * 1.02:
                best, best_rate = n, rate
        return best

    def heads_cost(self, batch: int) -> float:
        """Measured seconds for the heads + their LM head on ``batch`` hidden states (median of 3)."""
        if batch not in self._heads_cost:
            h = torch.zeros(batch, self.heads.hidden_size, dtype=self.lm_weight.dtype, device=self.lm_weight.device)
            ts = []
            for _ in range(4):
                t0 = time.perf_counter()
                self.candidates(h)
                ts.append(time.perf_counter() - t0)
            self._heads_cost[batch] = rank0_value(sorted(ts[1:])[1])  # one decision on every tensor-parallel rank
        return self._heads_cost[batch]

    # ---------------------------------------------------------------------------------------- proposing
    @torch.inference_mode()
    def candidates(self, h: torch.Tensor) -> torch.Tensor:
        """[B, d] hidden states -> [B, D, top_k] candidate token ids per depth."""
        z = self.heads(h.to(self.lm_weight.dtype))
        logits = self.readout(z)  # [B, H, V']
        cand = ranked_candidates(logits, self.heads, self.top_k)
        return cand if self.subset is None else self.subset[cand]

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        props = [Proposal([]) for _ in seqs]
        rows, hidden = self.fresh_hidden(seqs, budgets)
        if hidden is None:
            return props
        cand = self.candidates(hidden).tolist()
        for i, c in zip(rows, cand):
            tokens, parents = T.materialize(self.paths[: budgets[i]], c)
            props[i] = Proposal(tokens, None, parents)
        return props


METHOD = Method(
    name="medusa",
    options=(MedusaOptions,),
    shared=frozenset({"model", "use_cost_model"}),
    # under auto "model" names a draft model: the shipped heads
    build=lambda cfg, view, auto: MedusaProposer.from_config(cfg, view, str(MEDUSA_DIR) if auto else None),
    artifact="medusa",
    auto=AutoUse("hidden", rank=0, options=(MedusaOptions,),
                 usable=lambda cfg, target: target is not None and shipped_heads_for(target) is not None),
)

__all__ = ["DEFAULT_TOP_K", "METHOD", "MedusaOptions", "MedusaProposer"]

"""Hybrid drafting: a draft chain is the trunk of a candidate tree, Medusa heads add branches beside it.

Why: a chain drafter guesses several tokens in a row well, Medusa heads give cheap alternatives at each depth,
and one tree verification checks both. The tree for one sequence::

    root (last committed token)
     ├─ t1 ─ t2 ─ t3 ─ m4          trunk t1..t3: the chain drafter's tokens (self_spec or a draft model)
     ├─ b1   ├─ b2   └─ b3         b_d: the heads' best candidates for depth d other than t_d (``branches`` each)
                                   m4: the heads' guess for the depth after the trunk (a child of its last node)

Node order is trunk first (node i = t_{i+1}), so the trunk sits in the sequential KV slots right after the root,
exactly where a chain would be: a self_spec trunk's shared-layer K/V and captured hidden states stay valid when
the trunk is accepted. Verification is the engine's tree walk (tree.py): greedy follows the target's argmax
(lossless); sampling draws from the target at each node and descends if the draw is a child (lossless for any
candidate set), so the trunk drafter proposes its argmax even for sampled requests (``argmax_drafts``) and never
draws from the sequence's random stream: a seeded request gives exactly the tokens of plain decoding.

Bookkeeping: the chain drafter is told how many *trunk* nodes were accepted (the leading part of the accepted
path); a branch node that was accepted instead is new to it, like the bonus token, and it catches up on it next
step. The trunk length follows the dynamic-γ rule on the trunk's acceptance, sized by the engine's cost model;
``expected_tokens`` adds the measured rate at which a branch rescues a rejected trunk node.

Config (options.HybridOptions): ``{"method": "hybrid"}`` uses the shipped self_spec adapter as the trunk and the
shipped Medusa heads; ``"model": PATH`` makes a draft model the trunk (an HF/GGUF model, ``"target"``: the target
itself, e.g. with ``draft_linear_kernel``, or a ``leapdecode train draft-model`` folder; a folder holding a
feature-conditioned draft makes an ``eagle`` trunk), unless ``"trunk"`` says which drafter PATH is for
(``"self_spec"``: an exit adapter, ``"eagle"``: a feature draft, shipped or PATH); ``"trunk": "draft_model"``
without a path takes the shipped draft; ``"heads": PATH`` other heads, ``"branches": N`` candidates per depth
beside the trunk (default 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from leapdecode.config import SpeculativeConfig
from leapdecode.engine.sequence import Sequence
from leapdecode.speculative.artifacts import MEDUSA_DIR, is_feature_draft
from leapdecode.speculative.method import Method
from leapdecode.speculative.methods.draft_model import make_draft_model
from leapdecode.speculative.methods.eagle import EagleProposer
from leapdecode.speculative.methods.medusa import DEFAULT_TOP_K, MedusaOptions, MedusaProposer
from leapdecode.speculative.methods.self_spec import SelfSpecProposer
from leapdecode.speculative.options import CHAIN_KEYS, DrafterOptions, check, is_int
from leapdecode.speculative.policy import DynamicGamma, GammaState, expected_tokens
from leapdecode.speculative.proposer import EngineView, Proposal, Proposer, StepCost, Verification
from leapdecode.speculative.shadow_cache import ShadowCacheProposer

DEFAULT_BRANCHES = 1
TrunkMethod = Literal["self_spec", "draft_model", "eagle"]
TRUNKS: tuple[str, ...] = get_args(TrunkMethod)
RESCUE_PRIOR = 0.2  # chance that a branch saves a rejected trunk node, before any measurement
RESCUE_EMA = 0.05


@dataclass(frozen=True)
class HybridOptions:
    """Hybrid trees (methods/hybrid.py): the ``trunk`` chain drafter (None: ``draft_model`` when "model" is
    given, else ``self_spec``), other Medusa ``heads`` (a folder; None: the shipped ones) and ``branches``
    candidates per depth beside the trunk, drawn from the heads' ``top_k`` best."""

    trunk: TrunkMethod | None = None
    heads: str | None = None
    branches: int = DEFAULT_BRANCHES
    top_k: int = DEFAULT_TOP_K

    def __post_init__(self) -> None:
        check(self.trunk is None or self.trunk in TRUNKS,
               f"trunk must be one of {TRUNKS}, got {self.trunk!r}")
        check(self.heads is None or isinstance(self.heads, str), f"heads must be a folder path, got {self.heads!r}")
        check(is_int(self.branches, 0), f"branches must be an integer >= 0, got {self.branches!r}")
        check(is_int(self.top_k, 1), f"top_k must be an integer >= 1, got {self.top_k!r}")


def hybrid_tree(trunk: list[int], candidates: list[list[int]] | None, branches: int,
                budget: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the tree above: ``trunk`` as nodes 0..len-1, then for each depth d = 1..len+1 that the
    heads cover, up to ``branches`` of ``candidates[d-1]`` (best first) that differ from t_d, as children of
    t_{d-1} (the root for d = 1). The depth after the trunk takes one candidate. At most ``budget`` nodes; a
    prefix of the node list is always a valid tree (parents come first)."""
    tokens, parents = list(trunk[:budget]), list(range(-1, min(len(trunk), budget) - 1))
    if candidates is None:
        return tokens, parents
    for d in range(1, min(len(trunk) + 1, len(candidates)) + 1):
        want = branches if d <= len(trunk) else 1
        taken = 0
        for c in candidates[d - 1]:
            if taken >= want or len(tokens) >= budget:
                break
            if d <= len(trunk) and c == trunk[d - 1]:
                continue
            tokens.append(c)
            parents.append(d - 2)  # trunk node d-1 (index d-2), or -1: the root
            taken += 1
    return tokens, parents


def default_trunk(model: str | None) -> TrunkMethod:
    """The trunk when the config names none: the shipped exit adapter without "model"; with one, an ``eagle``
    trunk when the folder holds a feature-conditioned draft, else a draft model."""
    if model is None:
        return "self_spec"
    return "eagle" if is_feature_draft(model) else "draft_model"


def make_trunk(cfg: SpeculativeConfig, view: EngineView, trunk: TrunkMethod) -> ShadowCacheProposer:
    """The trunk's chain drafter ("model", if given, names its checkpoint or folder). An eagle trunk drafts a
    chain: the hybrid builds its own tree."""
    if trunk == "draft_model":
        return make_draft_model(cfg, view)
    if trunk == "eagle":
        return EagleProposer.from_config(cfg, view)
    return SelfSpecProposer.from_config(cfg, view, kind="self_spec")


@dataclass
class TrunkState:
    """One sequence's trunk: its draft length state, the trunk length this step asked for and the one drafted."""

    gamma: GammaState
    asked: int | None = None
    drafted: int = 0


class HybridProposer(Proposer):
    """A chain drafter's trunk plus Medusa branches, verified as one tree. Invariant: the chain drafter's shadow
    state only ever advances by accepted *trunk* nodes (``on_verified``)."""

    name = "hybrid"
    observes = True  # the heads read the target's hidden state

    def __init__(self, chain: ShadowCacheProposer, heads: MedusaProposer, branches: int = DEFAULT_BRANCHES,
                 gamma: DynamicGamma | None = None) -> None:
        self.chain = chain
        self.heads = heads
        self.branches = branches
        self.gamma = gamma
        self.rescue_rate = RESCUE_PRIOR  # measured: P(a branch is accepted | trunk rejected at a depth with one)
        self.num_rescues = 0
        self._last_trunk = 1
        self.trunks: dict[str, TrunkState] = {}  # request id -> its trunk

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, view: EngineView) -> HybridProposer:
        opts = cfg.options(HybridOptions)
        # "model" names the trunk's drafter here, so the heads come from "heads" or the shipped folder
        heads = MedusaProposer.from_config(cfg, view, heads_dir=opts.heads or str(MEDUSA_DIR),
                                           opts=MedusaOptions(top_k=opts.top_k))
        chain = make_trunk(cfg, view, opts.trunk or default_trunk(cfg.model))
        chain.argmax_drafts = True  # candidates for the tree walk (see above)
        return cls(chain, heads, opts.branches, DynamicGamma(cfg))

    # ---------------------------------------------------------------------------------------- sizing
    def _trunk(self, seq: Sequence) -> TrunkState:
        st = self.trunks.get(seq.request_id)
        if st is None:
            assert self.gamma is not None
            st = self.trunks[seq.request_id] = TrunkState(self.gamma.new_state())
            st.gamma.acceptance_ema = self.chain.acceptance_prior()
        return st

    def _state(self, seq: Sequence) -> GammaState:
        return self._trunk(seq).gamma

    def expected_tokens(self, alpha: float, trunk: int) -> float:
        """Chain tokens per step, plus a rescued node where the trunk is first rejected at a depth with branches."""
        depth = min(trunk, self.heads.heads.max_offset) if self.branches else 0
        rescue = sum(alpha ** (j - 1) * (1 - alpha) for j in range(1, depth + 1))
        return expected_tokens(alpha, trunk) + self.rescue_rate * rescue

    def nodes_for(self, trunk: int) -> int:
        depth = self.heads.heads.max_offset
        return trunk + self.branches * min(trunk, depth) + (1 if trunk < depth else 0)

    def tree_budget(self, seq: Sequence, room: int, cost: StepCost | None, batch: int) -> tuple[int, float]:
        st = self._state(seq)
        trunk = max(1, min(st.gamma, room))
        if cost is not None:  # the trunk length whose whole tree pays best (0: plain decoding)
            trunk = cost.best_gamma(st.acceptance_ema, trunk, batch, batch,
                                    lambda g: self.chain.step_cost(batch, g) + self.heads.step_cost(batch, 1),
                                    rows=lambda g: min(self.nodes_for(g), room), expected=self.expected_tokens)
        if trunk == 0:
            st.acceptance_ema += 0.05 * (self.chain.acceptance_prior() - st.acceptance_ema)  # retry later
            return 0, 1.0
        self._trunk(seq).asked = trunk
        self._last_trunk = trunk
        return min(self.nodes_for(trunk), room), self.expected_tokens(st.acceptance_ema, trunk)

    def memory_bytes(self) -> int:
        return self.chain.memory_bytes() + self.heads.memory_bytes()

    def calibrate_cost(self) -> None:
        self.chain.calibrate_cost()  # the heads time themselves on first use

    def step_cost(self, num_seqs: int, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.chain.step_cost(num_seqs, self._last_trunk) + self.heads.step_cost(num_seqs, 1)

    # ---------------------------------------------------------------------------------------- drafting
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        asked = [self._trunk(s).asked for s in seqs]
        trunks = [min(b, b if a is None else a) if b > 0 else 0 for a, b in zip(asked, budgets)]
        chain = self.chain.propose(seqs, trunks)
        rows, hidden = self.heads.fresh_hidden(seqs, budgets)
        cand: dict[int, list[list[int]]] = {}
        if hidden is not None:
            cand = dict(zip(rows, self.heads.candidates(hidden).tolist()))
        props = []
        for i, (seq, budget) in enumerate(zip(seqs, budgets)):
            trunk = list(chain[i].tokens)
            if budget <= 0 or (not trunk and i not in cand):
                self._trunk(seq).drafted = 0
                props.append(Proposal([]))
                continue
            tokens, parents = hybrid_tree(trunk, cand.get(i), self.branches, budget)
            self._trunk(seq).drafted = min(len(trunk), budget)
            props.append(Proposal(tokens, None, parents))
        return props

    def on_verified(self, seq: Sequence, result: Verification) -> None:
        """The trunk drafter is told its chain's share: the trunk nodes (the first ``drafted``, whose rows are the
        first of the logits too) and the accepted path's prefix that runs along them."""
        st = self._trunk(seq)
        path = result.accepted
        trunk_len, st.drafted = st.drafted, 0
        on_trunk = 0
        while on_trunk < min(len(path), trunk_len) and path[on_trunk] == on_trunk:
            on_trunk += 1
        self.chain.on_verified(seq, Verification(result.num_prefix_tokens, result.drafts[:trunk_len], None,
                                                 list(range(on_trunk)), result.committed,
                                                 result.logits[: trunk_len + 1]))
        if trunk_len:
            assert self.gamma is not None
            self.gamma.update(self._state(seq), trunk_len, on_trunk)
        if self.branches and on_trunk < trunk_len and on_trunk < self.heads.heads.max_offset:
            rescued = len(path) > on_trunk
            self.num_rescues += rescued
            self.rescue_rate += RESCUE_EMA * (float(rescued) - self.rescue_rate)

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        self.chain.observe(seq, hidden)
        self.heads.observe(seq, hidden)

    def release(self, seq: Sequence) -> None:
        self.chain.release(seq)
        self.heads.release(seq)
        self.trunks.pop(seq.request_id, None)


METHOD = Method(
    name="hybrid",
    options=(HybridOptions, DrafterOptions),
    shared=frozenset({"model", "draft_linear_kernel"}) | CHAIN_KEYS,
    build=lambda cfg, view, auto: HybridProposer.from_config(cfg, view),
)

__all__ = ["METHOD", "HybridOptions", "HybridProposer", "TrunkState", "default_trunk", "hybrid_tree", "make_trunk"]

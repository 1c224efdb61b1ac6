"""Medusa heads: extra decoding heads on the target's last hidden state, proposing a candidate tree per step.

Each head is one residual block ``z = h + SiLU(W h + b)`` followed by the target's own (frozen, tied) LM head, so
a head adds ``d^2 + d`` parameters (0.33M for SmolLM2-135M's d = 576) and nothing vocabulary-sized. Head i is
trained to predict the token ``offsets[i]`` places after the one the target's own head predicts from the same
hidden state (offset 1 = the token after next).

Layout. ``offsets`` lists one entry per head; the default *pyramid* ``1,2,2,3,3,3,4,4,4,4`` spends more heads where
uncertainty is higher; ``1,2,3,4`` (one per offset) is the comparison point. Heads that share an offset would
learn the same thing from the same data, so they are made to differ (``diversity``):

- ``"exclude"`` (default): head j of an offset is trained with the top-1 choices of heads 0..j-1 of that offset
  masked out of its softmax (positions where one of them is right do not train it), i.e. it learns "the best
  *other* guess". The offset's candidate list is then ``[c_0, c_1, .., c_{m-1}]`` (each head's masked argmax)
  followed by head 0's ranking; the first head starts from zero weights (the residual block is the identity, so
  it begins by predicting what the target's own head predicts), later heads from small random weights.
- ``"ensemble"``: independently initialised heads trained on the same objective; candidates are the top-k of
  their averaged distribution.

Vocabulary subset. Training on the 49k-wide LM head dominates cost on a CPU, so the trainer can restrict the
heads to the most frequent tokens of the training answers (``vocab_subset``, e.g. 8192 ids covering ~98% of
them); the same subset is used at inference, which also makes the heads' LM-head read ~6x smaller per step.

Inference. The engine hands the proposer the final hidden state of the position whose logits produced the last
emitted token (``observe``); the next step proposes a tree of the heads' ranked candidates (tree.py), shaped by
the rank paths measured on held-out data when the heads were trained (``tree`` in config.json). The number of
tree nodes is chosen from the engine's measured step-cost model and that expected-tokens curve (or fixed with
``tree_nodes``).

Artefact folder: ``heads.safetensors`` (``weight`` [H, d, d], ``bias`` [H, d], optional ``vocab_subset`` [V']),
``config.json`` (layout, tree statistics, validation metrics) and ``recipe.json`` (the exact command, data and seed
that produced it). The package ships trained heads for the bundled SmolLM2-135M-Instruct in
``leapdecode/artifacts/medusa/``.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from leapdecode.engine.sequence import Sequence
from leapdecode.layers import small_gemm
from leapdecode.spec import tree as T
from leapdecode.spec.proposer import Proposal, Proposer

DEFAULT_HEADS_DIR = Path(__file__).resolve().parent.parent / "artifacts" / "medusa"
FORMAT = "leapdecode-medusa-v1"
PYRAMID: tuple[int, ...] = (1, 2, 2, 3, 3, 3, 4, 4, 4, 4)
ONE_PER_OFFSET: tuple[int, ...] = (1, 2, 3, 4)
LAYOUTS: dict[str, tuple[int, ...]] = {"pyramid": PYRAMID, "one-per-offset": ONE_PER_OFFSET, "chain": ONE_PER_OFFSET}
DIVERSITY = ("exclude", "ensemble")
DEFAULT_TOPK = 10  # candidates per depth the tree may draw from
FALLBACK_NODES = 8  # tree size when neither statistics nor a cost model say otherwise


def parse_layout(layout: str | Seq[int]) -> list[int]:
    """``"pyramid"``, ``"one-per-offset"``, ``"1,2,2,3"`` or a list of offsets -> sorted list of offsets."""
    if isinstance(layout, str):
        offsets = list(LAYOUTS[layout]) if layout in LAYOUTS else [int(x) for x in layout.split(",") if x.strip()]
    else:
        offsets = [int(x) for x in layout]
    if not offsets or min(offsets) < 1:
        raise ValueError(f"a Medusa layout is a non-empty list of offsets >= 1, got {layout!r}")
    missing = sorted(set(range(1, max(offsets) + 1)) - set(offsets))
    if missing:
        raise ValueError(f"layout {layout!r} skips offsets {missing}: a tree needs a head at every depth")
    return sorted(offsets)


class MedusaHeads(nn.Module):
    """All heads' residual blocks as one batched matmul: ``forward(h [N, d]) -> [N, H, d]`` (before the LM head).

    ``groups[d]`` are the indices of the heads on offset d, in their rank order (head 0 of a group is the one
    whose ranking fills the candidate list after every head's top choice)."""

    def __init__(self, hidden_size: int, offsets: Seq[int], diversity: str = "exclude") -> None:
        super().__init__()
        if diversity not in DIVERSITY:
            raise ValueError(f"diversity must be one of {DIVERSITY}, got {diversity!r}")
        self.offsets = parse_layout(list(offsets))
        self.hidden_size = hidden_size
        self.diversity = diversity
        n = len(self.offsets)
        self.weight = nn.Parameter(torch.zeros(n, hidden_size, hidden_size))  # [head, out, in]
        self.bias = nn.Parameter(torch.zeros(n, hidden_size))
        self.groups: dict[int, list[int]] = {}
        for i, o in enumerate(self.offsets):
            self.groups.setdefault(o, []).append(i)

    @property
    def num_heads(self) -> int:
        return len(self.offsets)

    @property
    def max_offset(self) -> int:
        return max(self.offsets)

    def rank_in_group(self, head: int) -> int:
        return self.groups[self.offsets[head]].index(head)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """First head of each offset: zero (identity block); the others: N(0, std) from per-head seeds, so heads
        on one offset start apart. (``ensemble`` heads all start random, from different seeds.)"""
        for i in range(self.num_heads):
            self.bias[i].zero_()
            if self.diversity == "exclude" and self.rank_in_group(i) == 0:
                self.weight[i].zero_()
            else:
                g = torch.Generator().manual_seed(seed * 1000 + i)
                self.weight[i].copy_(torch.randn(self.hidden_size, self.hidden_size, generator=g) * std)

    def forward(self, h: torch.Tensor, heads: Seq[int] | None = None) -> torch.Tensor:
        """``h``: [N, d] final-norm hidden states; ``heads``: subset of head indices (default all)."""
        w, b = self.weight, self.bias
        if heads is not None:
            idx = torch.as_tensor(list(heads), dtype=torch.long, device=w.device)
            w, b = w.index_select(0, idx), b.index_select(0, idx)
        n, d = w.shape[0], self.hidden_size
        z = F.linear(h, w.reshape(n * d, d), b.reshape(n * d)).view(h.shape[0], n, d)
        return h.unsqueeze(1) + F.silu(z)


def exclusion_fill(first_logits: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """``chosen`` [N, m] distinct ids followed by the best ``k - m`` ids of ``first_logits`` [N, V] that are not
    in ``chosen``: the merged candidate list of an offset under ``exclude`` diversity. Returns [N, k]."""
    m = chosen.shape[1]
    if k <= m:
        return chosen[:, :k]
    top = first_logits.topk(min(k + m, first_logits.shape[1]), dim=-1).indices
    dup = (top.unsqueeze(2) == chosen.unsqueeze(1)).any(dim=2)
    order = dup.to(torch.int8).argsort(dim=1, stable=True)
    fill = top.gather(1, order)[:, : k - m]
    return torch.cat([chosen, fill], dim=1)


def masked_argmax_chain(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [N, m, V] of one offset's heads in rank order -> [N, m]: each head's argmax with the previous
    heads' choices masked out (distinct by construction)."""
    n, m, _ = logits.shape
    chosen = torch.empty(n, m, dtype=torch.long, device=logits.device)
    for j in range(m):
        lj = logits[:, j]
        if j:
            lj = lj.scatter(1, chosen[:, :j], float("-inf"))
        chosen[:, j] = lj.argmax(dim=-1)
    return chosen


def ranked_candidates(logits: torch.Tensor, heads: MedusaHeads, k: int) -> torch.Tensor:
    """``logits`` [N, H, V] of all heads -> [N, D, k] candidate ids per depth (D = max offset), best first,
    distinct within a depth."""
    out = []
    for d in range(1, heads.max_offset + 1):
        g = heads.groups[d]
        lg = logits[:, g]
        if heads.diversity == "exclude":
            out.append(exclusion_fill(lg[:, 0], masked_argmax_chain(lg), k))
        else:
            p = lg.float().softmax(dim=-1).mean(dim=1)
            out.append(p.topk(min(k, p.shape[-1]), dim=-1).indices)
    return torch.stack(out, dim=1)


# ------------------------------------------------------------------------------------------------ artefact
def save_heads(
    folder: str | Path,
    heads: MedusaHeads,
    vocab_subset: torch.Tensor | None,
    meta: dict[str, Any],
    recipe: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float16,
) -> None:
    """Write the artefact folder (fp16 weights keep the shipped pyramid at ~6.6 MB for d = 576)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"weight": heads.weight.detach().to(dtype).contiguous(), "bias": heads.bias.detach().to(dtype)}
    if vocab_subset is not None:
        tensors["vocab_subset"] = vocab_subset.to(torch.int32).contiguous()
    save_file(tensors, str(folder / "heads.safetensors"))
    cfg = {"format": FORMAT, "hidden_size": heads.hidden_size, "offsets": heads.offsets,
           "diversity": heads.diversity, **meta}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    if recipe is not None:
        (folder / "recipe.json").write_text(json.dumps(recipe, indent=2))


def load_heads(folder: str | Path) -> tuple[MedusaHeads, torch.Tensor | None, dict[str, Any]]:
    """(heads in float32, vocab subset ids or None, config dict) from an artefact folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "heads.safetensors").is_file() or not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"no Medusa heads in {folder} (need heads.safetensors and config.json); train them with "
            "`leapdecode train medusa --data DIR --out FOLDER` (see leapdecode/train/medusa.py)"
        )
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("format") != FORMAT:
        raise ValueError(f"{folder}/config.json is not a {FORMAT} artefact (format={cfg.get('format')!r})")
    t = load_file(str(folder / "heads.safetensors"))
    heads = MedusaHeads(cfg["hidden_size"], cfg["offsets"], cfg.get("diversity", "exclude"))
    with torch.no_grad():
        heads.weight.copy_(t["weight"].float())
        heads.bias.copy_(t["bias"].float())
    subset = t["vocab_subset"].long() if "vocab_subset" in t else None
    return heads.requires_grad_(False).eval(), subset, cfg


def shipped_heads_for(target) -> Path | None:
    """The shipped heads when they were trained for this target (same shapes and LM-head fingerprint), else
    None; ``auto`` only offers Medusa then."""
    cfg_file = DEFAULT_HEADS_DIR / "config.json"
    if not (DEFAULT_HEADS_DIR / "heads.safetensors").is_file() or not cfg_file.is_file():
        return None
    try:
        meta = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return None
    mcfg = target.config
    if meta.get("hidden_size") != mcfg.hidden_size or meta.get("vocab_size", mcfg.vocab_size) != mcfg.vocab_size:
        return None
    fp = meta.get("base_model", {}).get("lm_head_fingerprint")
    here = lm_head_fingerprint(target.lm_head.get_weight())
    if fp is None or any(abs(a - b) > 1e-2 * max(1.0, abs(b)) for a, b in zip(fp, here)):
        return None
    return DEFAULT_HEADS_DIR


def check_heads_fit(
    folder: Path, heads: MedusaHeads, meta: dict[str, Any], engine, kind: str = "Medusa"
) -> torch.Tensor:
    """The engine's LM-head weight (the heads' own output layer) once the heads are known to fit its model:
    a wrong hidden size or vocabulary is an error; heads trained on another model of the same shape (LM-head
    fingerprint differs) only warn, since they still run, just with low acceptance. Shared by every method
    whose heads come from ``leapdecode train medusa`` (Medusa trees, blockwise chains)."""
    mcfg = engine.model_config
    if heads.hidden_size != mcfg.hidden_size:
        raise ValueError(
            f"the {kind} heads in {folder} are for hidden size {heads.hidden_size} "
            f"({meta.get('base_model', {}).get('name', 'another model')}), this model has {mcfg.hidden_size}; "
            'pass "model": PATH to heads trained for it (leapdecode train medusa)'
        )
    if meta.get("vocab_size", mcfg.vocab_size) != mcfg.vocab_size:
        raise ValueError(f"the {kind} heads in {folder} are for a {meta['vocab_size']}-token vocabulary, "
                         f"this model has {mcfg.vocab_size}")
    weight = engine.model.lm_head.get_weight()
    fp = meta.get("base_model", {}).get("lm_head_fingerprint")
    here = lm_head_fingerprint(weight)
    if fp is not None and not all(abs(a - b) <= 1e-2 * max(1.0, abs(a)) for a, b in zip(fp, here)):
        warnings.warn(f"the {kind} heads in {folder} were trained on another model "
                      f"({meta.get('base_model', {}).get('name')}); expect low acceptance", stacklevel=3)
    return weight


def lm_head_fingerprint(weight: torch.Tensor) -> list[float]:
    """A few sums of the LM head, to warn when heads are loaded onto a different model of the same shape."""
    w = weight.detach().float().cpu()
    return [round(float(w[:256].sum()), 3), round(float(w[-256:].abs().sum()), 3)]


# ------------------------------------------------------------------------------------------------ proposer
class HeadsProposer(Proposer):
    """A drafter that reads the target's last hidden state through trained heads and the target's own LM head
    (Medusa trees, blockwise chains). Invariant: ``seq.spec_state[self.hidden_key]`` holds ``(n, h)``, the hidden
    state that predicted the last emitted token of ``seq`` when it had ``n`` tokens; a proposal is made only from
    a state whose ``n`` is the sequence's current length (a preempted or rewound sequence must not draft from a
    stale one)."""

    def __init__(self, heads: MedusaHeads, lm_weight: torch.Tensor, vocab_subset: torch.Tensor | None) -> None:
        dev, dt = lm_weight.device, lm_weight.dtype
        self.heads = heads.to(device=dev, dtype=dt)
        self.subset = None if vocab_subset is None else vocab_subset.to(dev)
        # the heads' read-out: the target's own LM head, restricted to the vocabulary subset they were trained on
        self.lm_weight = lm_weight if vocab_subset is None else lm_weight.index_select(0, self.subset).contiguous()
        self.lm_packed: torch.Tensor | None = None  # the read-out through the few-row kernel (pack_readout)
        self.hidden_key = f"{self.name}_hidden"

    def pack_readout(self, engine) -> None:
        """Read the heads out through the engine's few-row kernel when the target uses it: from the LM head's own
        Q8 blocks where it has them (the subset of a 49k-row head is ~19 MB in float32 per step, ~5 MB in Q8)."""
        if engine.num_packed_linears:
            self.lm_packed = small_gemm.pack_rows(engine.model.lm_head, self.subset, self.lm_weight)

    def readout(self, z: torch.Tensor) -> torch.Tensor:
        """[..., d] head states -> [..., V'] logits over the heads' vocabulary."""
        flat = small_gemm.linear(z.reshape(-1, z.shape[-1]), self.lm_weight, None, self.lm_packed)
        return flat.view(*z.shape[:-1], -1)

    def observe(self, seq: Sequence, hidden: torch.Tensor) -> None:
        if seq.params.speculative:
            seq.spec_state[self.hidden_key] = (seq.num_tokens, hidden.detach().reshape(-1).clone())

    def release(self, seq: Sequence) -> None:
        seq.spec_state.pop(self.hidden_key, None)

    def fresh_hidden(self, seqs: list[Sequence], budgets: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Indices of the sequences that may draft this step (budget > 0 and a current hidden state) and their
        hidden states stacked [len(rows), d] (None when there are none)."""
        rows, hs = [], []
        for i, (seq, k) in enumerate(zip(seqs, budgets)):
            st = seq.spec_state.get(self.hidden_key)
            if k > 0 and st is not None and st[0] == seq.num_tokens:
                rows.append(i)
                hs.append(st[1])
        return rows, (torch.stack(hs) if hs else None)


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
        topk: int = DEFAULT_TOPK,
        typical: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(heads, lm_weight, vocab_subset)
        if paths is None:
            paths = T.default_paths([min(topk, 4)] * min(heads.max_offset, 3))
        self.paths: list[tuple[int, ...]] = [tuple(p) for p in paths if len(p) <= heads.max_offset]
        self.curve = list(curve) if curve is not None else None
        self.topk = max([topk] + [p[-1] + 1 for p in self.paths])
        self.tree_nodes = tree_nodes
        self.default_nodes = default_nodes
        self.typical = typical
        self._best: dict[int, int] = {}
        self._heads_cost: dict[int, float] = {}

    # ----------------------------------------------------------------------------------------- loading
    @classmethod
    def from_config(cls, cfg, engine) -> MedusaProposer:
        """``speculative_config={"method": "medusa"}`` loads the shipped heads; ``"model": PATH`` others. Extra
        keys: ``tree_nodes`` (fixed tree size), ``topk``, ``typical_acceptance`` (bool, lossy, sampling only),
        ``posterior_threshold`` (eps, default 0.09), ``posterior_alpha`` (delta, default 0.3)."""
        folder = Path(cfg.model) if cfg.model else DEFAULT_HEADS_DIR
        heads, subset, meta = load_heads(folder)
        weight = check_heads_fit(folder, heads, meta, engine)
        ex = cfg.extra
        tree = meta.get("tree") or {}
        typical = None
        if ex.get("typical_acceptance"):
            typical = (float(ex.get("posterior_threshold", 0.09)), float(ex.get("posterior_alpha", 0.3)))
        nodes = ex.get("tree_nodes")
        if nodes is not None and (not isinstance(nodes, int) or nodes < 0):
            raise ValueError(f"tree_nodes must be an integer >= 0, got {nodes!r}")
        proposer = cls(heads, weight, subset, tree.get("paths"), tree.get("curve"), tree_nodes=nodes,
                       default_nodes=tree.get("default_nodes"), topk=int(ex.get("topk", DEFAULT_TOPK)),
                       typical=typical)
        proposer.pack_readout(engine)
        return proposer

    # ---------------------------------------------------------------------------------------- sizing
    def tree_budget(self, seq: Sequence, room: int, cost, batch: int) -> tuple[int, float]:
        """(nodes, expected tokens per step): fixed ``tree_nodes``; else the size that maximises expected
        tokens per second under the engine's measured step cost (0 = plain decoding pays better); else the
        artefact's tuned default. Trimming to ``room`` keeps a valid tree (paths are parents-first)."""
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

    def best_nodes(self, cost, batch: int) -> int:
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
            self._heads_cost[batch] = sorted(ts[1:])[1]
        return self._heads_cost[batch]

    # ---------------------------------------------------------------------------------------- proposing
    @torch.inference_mode()
    def candidates(self, h: torch.Tensor) -> torch.Tensor:
        """[B, d] hidden states -> [B, D, topk] candidate token ids per depth."""
        z = self.heads(h.to(self.lm_weight.dtype))
        logits = self.readout(z)  # [B, H, V']
        cand = ranked_candidates(logits, self.heads, self.topk)
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


__all__ = [
    "DEFAULT_HEADS_DIR",
    "MedusaHeads",
    "HeadsProposer",
    "MedusaProposer",
    "ONE_PER_OFFSET",
    "check_heads_fit",
    "PYRAMID",
    "exclusion_fill",
    "load_heads",
    "masked_argmax_chain",
    "parse_layout",
    "ranked_candidates",
    "save_heads",
]

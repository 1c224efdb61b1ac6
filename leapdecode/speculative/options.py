"""Typed options of the speculative methods: one frozen dataclass per group of knobs, and which groups each method
takes.

A ``speculative_config`` dict is flat (vLLM's convention: ``{"method": "eagle", "tree_nodes": 4}``);
``SpeculativeConfig.from_dict`` (leapdecode/config.py) files each key into the group that owns it and refuses a
key that the chosen method does not read, naming the keys it does. One spelling per concept across methods:
``top_k`` is "how many of the best-ranked tokens", ``tree_nodes`` "how many tree nodes the target verifies per
step". The spellings ``topk`` (Medusa) and ``tree_topk`` (EAGLE trees) are still read, with a DeprecationWarning.

This module imports nothing of leapdecode, so the engine's config can depend on it without a cycle.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

MethodName = Literal["ngram", "draft_model", "self_spec", "eagle", "medusa", "hybrid", "blockwise", "auto"]
METHODS: tuple[str, ...] = get_args(MethodName)
ChainMethod = Literal["ngram", "draft_model", "self_spec", "eagle", "medusa"]
AUTO_CANDIDATES: tuple[str, ...] = get_args(ChainMethod)  # what ``auto`` may choose among
TrunkMethod = Literal["self_spec", "draft_model", "eagle"]
TRUNKS: tuple[str, ...] = get_args(TrunkMethod)
DraftPrecision = Literal["int8", "float32"]
DRAFT_PRECISIONS: tuple[str, ...] = get_args(DraftPrecision)
Acceptance = Literal["exact", "topk"]
ACCEPTANCE: tuple[str, ...] = get_args(Acceptance)
# old spelling -> the one spelling; still read (with a warning) because the README and bench records used them
DEPRECATED_KEYS = {"topk": "top_k", "tree_topk": "tree_top_k"}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _is_int(v: object, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _is_prob(v: object, high_open: bool = False) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return 0.0 <= float(v) < 1.0 if high_open else 0.0 <= float(v) <= 1.0


@dataclass(frozen=True)
class DrafterOptions:
    """Trained drafters (self_spec, a trained draft_model, eagle; a hybrid's trunk). ``None``: the artefact's
    value. ``min_draft_prob``: stop a chain when the draft's top probability falls below it (default 0.3);
    ``draft_vocab``: score only the N most frequent tokens of the artefact's ranked vocabulary (0 = the whole LM
    head); ``draft_precision``: the drafter's own layers as Q8_0 with int8 activations on a CPU, or float32."""

    min_draft_prob: float | None = None
    draft_vocab: int | None = None
    draft_precision: DraftPrecision = "int8"

    def __post_init__(self) -> None:
        _check(self.min_draft_prob is None or _is_prob(self.min_draft_prob),
               f"min_draft_prob must be a number in [0, 1], got {self.min_draft_prob!r}")
        _check(self.draft_vocab is None or _is_int(self.draft_vocab, 0),
               f"draft_vocab must be an integer >= 0, got {self.draft_vocab!r}")
        _check(self.draft_precision in DRAFT_PRECISIONS,
               f"draft_precision must be one of {DRAFT_PRECISIONS}, got {self.draft_precision!r}")


@dataclass(frozen=True)
class EagleTreeOptions:
    """EAGLE's dynamic draft tree (methods/eagle.py): ``tree_nodes`` > 0 grows a tree and verifies its N best
    nodes (0: a chain); each pass expands the ``tree_beam`` best nodes of the newest depth into their
    ``tree_top_k`` children, for ``tree_depth`` depths, never adding a node below ``tree_min_prob``. The defaults
    were chosen on MT-Bench development prompts at batch 1 on a 2-core CPU (README: the eagle tree table)."""

    tree_nodes: int = 0
    tree_top_k: int = 2
    tree_beam: int = 2
    tree_depth: int = 3
    tree_min_prob: float = 0.05

    def __post_init__(self) -> None:
        for key, low in (("tree_nodes", 0), ("tree_top_k", 1), ("tree_beam", 1), ("tree_depth", 1)):
            v = getattr(self, key)
            _check(_is_int(v, low), f"{key} must be an integer >= {low}, got {v!r}")
        _check(_is_prob(self.tree_min_prob, high_open=True),
               f"tree_min_prob must be a number in [0, 1), got {self.tree_min_prob!r}")


@dataclass(frozen=True)
class MedusaOptions:
    """Medusa trees (methods/medusa.py): ``tree_nodes`` fixes the tree size (None: sized by the step-cost model or
    the artefact); ``top_k`` candidates per depth the tree may draw from; ``typical_acceptance`` (lossy, sampled
    requests only) with its bar ``min(posterior_threshold, posterior_alpha * exp(-H(p)))``."""

    tree_nodes: int | None = None
    top_k: int = 10
    typical_acceptance: bool = False
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self) -> None:
        _check(self.tree_nodes is None or _is_int(self.tree_nodes, 0),
               f"tree_nodes must be an integer >= 0, got {self.tree_nodes!r}")
        _check(_is_int(self.top_k, 1), f"top_k must be an integer >= 1, got {self.top_k!r}")
        _check(isinstance(self.typical_acceptance, bool),
               f"typical_acceptance must be true or false, got {self.typical_acceptance!r}")
        for key in ("posterior_threshold", "posterior_alpha"):
            _check(_is_prob(getattr(self, key)), f"{key} must be a number in [0, 1], got {getattr(self, key)!r}")


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
        _check(self.acceptance in ACCEPTANCE,
               f"blockwise acceptance must be one of {ACCEPTANCE}, got {self.acceptance!r}")
        if self.acceptance == "exact":
            given = [k for k in ("top_k", "min_block") if getattr(self, k) is not None]
            _check(not given, f"{', '.join(given)} only apply to acceptance='topk' (lossy, opt-in); exact "
                              "acceptance is lossless and takes neither")
        _check(self.top_k is None or _is_int(self.top_k, 1),
               f"blockwise top_k must be an integer >= 1, got {self.top_k!r}")
        _check(self.min_block is None or _is_int(self.min_block, 0),
               f"blockwise min_block must be an integer in [0, k] (proposed tokens kept without the top-k test), "
               f"got {self.min_block!r}")


@dataclass(frozen=True)
class HybridOptions:
    """Hybrid trees (methods/hybrid.py): the ``trunk`` chain drafter (None: ``draft_model`` when "model" is
    given, else ``self_spec``), other Medusa ``heads`` (a folder; None: the shipped ones) and ``branches``
    candidates per depth beside the trunk."""

    trunk: TrunkMethod | None = None
    heads: str | None = None
    branches: int = 1

    def __post_init__(self) -> None:
        _check(self.trunk is None or self.trunk in TRUNKS,
               f"trunk must be one of {TRUNKS}, got {self.trunk!r}")
        _check(self.heads is None or isinstance(self.heads, str), f"heads must be a folder path, got {self.heads!r}")
        _check(_is_int(self.branches, 0), f"branches must be an integer >= 0, got {self.branches!r}")


@dataclass(frozen=True)
class AutoOptions:
    """``auto``, the strategy router (speculative/router.py). ``methods`` narrows the drafters it chooses among
    (None: every usable one). The user's constraints: ``lossless`` (False allows lossy block-parallel decoding
    where blockwise heads fit the model), ``minimal_change`` (only drafters that leave the target untouched:
    prompt lookup and a separate draft model, no drafter that reads the target's hidden states),
    ``latency_slo_ms`` (target time per output token: below 10 ms on the lossy branch the router drafts whole
    blocks without verification rejecting them), ``memory_budget_mb`` (the most memory a drafter may hold of
    its own: weights, caches), ``switch_domains`` (watch each request for copying vs free writing and re-weigh
    its drafters when that changes)."""

    methods: tuple[ChainMethod, ...] | None = None
    lossless: bool = True
    minimal_change: bool = False
    latency_slo_ms: float | None = None
    memory_budget_mb: float | None = None
    switch_domains: bool = True

    def __post_init__(self) -> None:
        m = self.methods
        _check(m is None or (isinstance(m, tuple) and len(m) > 0 and set(m) <= set(AUTO_CANDIDATES)),
               f'auto\'s "methods" must be a non-empty list drawn from {list(AUTO_CANDIDATES)}, got '
               f"{list(m) if isinstance(m, tuple) else m!r}")
        for key in ("lossless", "minimal_change", "switch_domains"):
            _check(isinstance(getattr(self, key), bool), f"{key} must be true or false, got {getattr(self, key)!r}")
        for key in ("latency_slo_ms", "memory_budget_mb"):
            v = getattr(self, key)
            _check(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0),
                   f"{key} must be a positive number (or null: no constraint), got {v!r}")


OPTION_GROUPS = {"drafter": DrafterOptions, "eagle_tree": EagleTreeOptions, "medusa": MedusaOptions,
                 "blockwise": BlockwiseOptions, "hybrid": HybridOptions, "auto": AutoOptions}
# which groups each method reads. A hybrid accepts the EAGLE tree keys and leaves its trunk a chain (it builds
# its own tree); under auto, tree_nodes sizes Medusa's tree (EAGLE runs as a chain there)
METHOD_GROUPS: dict[str, tuple[str, ...]] = {
    "ngram": (),
    "draft_model": ("drafter",),
    "self_spec": ("drafter",),
    "eagle": ("drafter", "eagle_tree"),
    "medusa": ("medusa",),
    "blockwise": ("blockwise",),
    "hybrid": ("hybrid", "drafter", "eagle_tree", "medusa"),
    "auto": ("auto", "drafter", "medusa"),
}
TREE_KEYS = tuple(f.name for f in fields(EagleTreeOptions))


def group_keys(group: str) -> tuple[str, ...]:
    return tuple(f.name for f in fields(OPTION_GROUPS[group]))


def split_options(method: str, options: dict[str, Any], common: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The method-specific keys of a flat config dict, filed by group (``{group: {key: value}}``). An old
    spelling is renamed with a DeprecationWarning; a key the method does not read is a ValueError that names the
    keys it does (``common``: the keys every method takes)."""
    groups = METHOD_GROUPS[method]
    out: dict[str, dict[str, Any]] = {}
    for key, value in options.items():
        if key in DEPRECATED_KEYS:
            new = DEPRECATED_KEYS[key]
            warnings.warn(f'speculative option "{key}" is deprecated; spell it "{new}"', DeprecationWarning,
                          stacklevel=4)
            if new in options:
                raise ValueError(f'speculative options "{key}" and "{new}" are the same; give only "{new}"')
            key = new
        owners = [g for g in groups if key in group_keys(g)]
        if not owners:
            if key in TREE_KEYS and method in ("self_spec", "draft_model"):
                raise ValueError(f"{key}: a dynamic draft tree needs the eagle method")
            valid = sorted(set(common) | {k for g in groups for k in group_keys(g)})
            raise ValueError(f"unknown speculative option {key!r} for method {method!r}; valid options: "
                             f"{', '.join(valid)}")
        for g in owners:
            out.setdefault(g, {})[key] = value
    if "methods" in out.get("auto", {}) and isinstance(out["auto"]["methods"], list):
        out["auto"]["methods"] = tuple(out["auto"]["methods"])
    return out


__all__ = [
    "ACCEPTANCE",
    "AUTO_CANDIDATES",
    "DRAFT_PRECISIONS",
    "METHODS",
    "METHOD_GROUPS",
    "TREE_KEYS",
    "TRUNKS",
    "AutoOptions",
    "BlockwiseOptions",
    "DrafterOptions",
    "EagleTreeOptions",
    "HybridOptions",
    "MedusaOptions",
    "MethodName",
    "split_options",
]

"""What a speculative method declares about itself: one ``Method`` descriptor per module under
``speculative/methods/``, in a module-level name ``METHOD``.

The registry (registry.py) finds the modules of that folder and collects their descriptors; the option parser,
``auto``'s list of candidates and its router, ``bench`` and ``train`` read the descriptors, and none of them names a
method. Adding a method is one new module here: its proposer (proposer.py, the protocol), its typed options and
its descriptor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from leapdecode.config import SHARED_KEYS, SpeculativeConfig
from leapdecode.models.llama import LlamaForCausalLM
from leapdecode.speculative.proposer import EngineView, Proposer

# (config, view, under_auto) -> the method's proposer. Under ``auto`` the config is auto's: "model" names a draft
# model there, so a method that reads a trained artifact takes its shipped one
Factory = Callable[[SpeculativeConfig, EngineView, bool], Proposer]
# the branches of auto's decision tree (router.py) a method can sit on: "separate" drafters leave the target
# untouched (the "minimal change" branch), "hidden" ones read the target's hidden states (the Medusa family),
# "lossy" ones are offered only when the user allows lossy decoding
AutoBranch = Literal["separate", "hidden", "lossy"]
AUTO_BRANCHES: tuple[AutoBranch, ...] = ("separate", "hidden", "lossy")


@dataclass(frozen=True)
class AutoUse:
    """Whether and how ``auto`` may pick a method.

    ``branch``: where it sits in the router's decision tree; ``rank``: its preference on that branch (lowest
    first); ``usable(config, target)``: whether auto can build it here without further arguments (a shipped
    artifact trained for this target, say); ``options``: the option groups it reads when auto builds it (auto's
    config accepts their keys); ``tracks_copying``: its acceptance is the share of text that repeats earlier text
    (prompt lookup), so the router's copy detector sets its estimate when a request switches domain;
    ``self_draft``: it drafts with the target itself (the layer-skip draft), which the difficulty-driven compute
    path (difficulty.py) prefers on easy text and keeps off its speculative branch."""

    branch: AutoBranch
    rank: int
    usable: Callable[[SpeculativeConfig, LlamaForCausalLM | None], bool]
    options: tuple[type, ...] = ()
    tracks_copying: bool = False
    self_draft: bool = False


@dataclass(frozen=True)
class Method:
    """One speculative method.

    ``name``: the value of ``"method"``; ``options``: its typed option groups (frozen dataclasses; their fields are
    the keys it takes besides the shared ones); ``shared``: the keys of ``SpeculativeConfig`` itself that it reads
    (``config.SHARED_KEYS``; every other shared key is refused for it); ``build``: its proposer's factory;
    ``artifact``: the kind of trained artifact it loads (its folder under ``leapdecode/artifacts/``; None: it
    needs none); ``auto``: how ``auto`` may use it (None: never); ``bench``: further labelled configurations
    ``leapdecode bench`` offers beside ``{"method": name}`` (e.g. a tree variant), and ``lossy_bench`` those whose
    output may differ from plain decoding (the report measures their quality)."""

    name: str
    options: tuple[type, ...]
    shared: frozenset[str]
    build: Factory
    artifact: str | None = None
    auto: AutoUse | None = None
    bench: Mapping[str, dict] = field(default_factory=dict)
    lossy_bench: Mapping[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.shared) - set(SHARED_KEYS)
        if unknown:
            raise ValueError(f"method {self.name!r} declares shared keys SpeculativeConfig lacks: {sorted(unknown)}")


__all__ = ["AUTO_BRANCHES", "AutoBranch", "AutoUse", "Factory", "Method"]

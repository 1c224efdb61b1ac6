"""Method name -> the factory that builds its proposer from a config and the engine's view.

Every method module is imported here, once, at the top: the arrows run from the registry down to the methods and
never back, so adding a method is one import and one entry.
"""

from __future__ import annotations

from collections.abc import Callable

from leapdecode.config import SpeculativeConfig
from leapdecode.speculative.artifacts import BLOCKWISE_DIR, MEDUSA_DIR
from leapdecode.speculative.methods.blockwise import BlockwiseProposer
from leapdecode.speculative.methods.draft_model import make_draft_model
from leapdecode.speculative.methods.eagle import EagleProposer
from leapdecode.speculative.methods.hybrid import HybridProposer
from leapdecode.speculative.methods.medusa import MedusaProposer
from leapdecode.speculative.methods.ngram import NgramProposer
from leapdecode.speculative.methods.self_spec import SelfSpecProposer
from leapdecode.speculative.proposer import EngineView, Proposer
from leapdecode.speculative.router import lossy_blockwise

# (config, view, under_auto) -> proposer. Under auto, "model" names a draft model, so the trained drafters other
# than draft_model take their shipped artefacts, and EAGLE drafts a chain (tree_nodes sizes Medusa's tree there)
Factory = Callable[[SpeculativeConfig, EngineView, bool], Proposer]

FACTORIES: dict[str, Factory] = {
    "ngram": lambda cfg, view, auto: NgramProposer.from_config(cfg),
    "draft_model": lambda cfg, view, auto: make_draft_model(cfg, view),
    "self_spec": lambda cfg, view, auto: SelfSpecProposer.from_config(cfg, view, "self_spec", shipped_only=auto),
    "eagle": lambda cfg, view, auto: EagleProposer.from_config(
        cfg, view, "eagle", shipped_only=auto, tree=None if auto else cfg.eagle_tree),
    "medusa": lambda cfg, view, auto: MedusaProposer.from_config(cfg, view, str(MEDUSA_DIR) if auto else None),
    # under auto only on the lossy branch: the shipped heads, with the router's lossy settings
    "blockwise": lambda cfg, view, auto: BlockwiseProposer.from_config(
        cfg, view, str(BLOCKWISE_DIR), lambda n: lossy_blockwise(cfg.auto, n)) if auto else
    BlockwiseProposer.from_config(cfg, view),
    "hybrid": lambda cfg, view, auto: HybridProposer.from_config(cfg, view),
}


def make_proposer(cfg: SpeculativeConfig, view: EngineView, method: str | None = None) -> Proposer:
    """The proposer of ``method`` (default: the config's; ``auto`` builds each of its candidates this way)."""
    method = method or cfg.method
    factory = FACTORIES.get(method)
    if factory is None:
        raise ValueError(f"unknown speculative method {method!r}; choose from {sorted(FACTORIES)}")
    return factory(cfg, view, cfg.method == "auto")


__all__ = ["FACTORIES", "make_proposer"]

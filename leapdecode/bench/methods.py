"""The speculative configurations ``leapdecode bench`` runs under each method label."""

from __future__ import annotations

METHOD_DEFAULTS: dict[str, dict | None] = {
    "none": None,
    "ngram": {"method": "ngram"},
    "draft_model": {"method": "draft_model"},
    "self_spec": {"method": "self_spec"},
    "eagle": {"method": "eagle"},
    "eagle_tree": {"method": "eagle", "tree_nodes": 4},  # the dynamic draft tree (speculative/methods/eagle.py)
    "medusa": {"method": "medusa"},
    "hybrid": {"method": "hybrid"},
    "blockwise": {"method": "blockwise"},
    "auto": {"method": "auto"},
}
# lossy options the report's quality table measures beside the lossless methods (label -> configuration)
LOSSY_DEFAULTS: dict[str, dict] = {
    "blockwise_topk": {"method": "blockwise", "acceptance": "topk", "top_k": 2},
}

__all__ = ["LOSSY_DEFAULTS", "METHOD_DEFAULTS"]

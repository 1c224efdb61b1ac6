"""The speculative configurations ``leapdecode bench`` runs under each method label: plain decoding, then what the
method descriptors offer (speculative/registry.py), so a new method is benchmarked without an edit here."""

from __future__ import annotations

from leapdecode.speculative.registry import bench_configs

METHOD_DEFAULTS: dict[str, dict | None] = {"none": None, **bench_configs()}
# lossy options the report's quality table measures beside the lossless methods (label -> configuration)
LOSSY_DEFAULTS: dict[str, dict] = bench_configs(lossy=True)

__all__ = ["LOSSY_DEFAULTS", "METHOD_DEFAULTS"]

"""Speculative decoding: drafters propose, the target verifies in one pass (docs/speculative.md)."""

"""Evaluation and micro-benchmark helpers (perplexity through the engine, attention path timing)."""

"""matplotlib, imported only when a plot is drawn (``bench --plot``/``--report``, ``eval.contention --plot``)."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend; matplotlib is an optional dependency (the ``plots`` extra),
    imported here so the rest of the CLI runs without it."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'leapdecode[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


__all__ = ["pyplot"]

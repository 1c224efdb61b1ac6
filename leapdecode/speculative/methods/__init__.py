"""One speculative method per module, each declaring its ``METHOD`` descriptor (speculative/method.py)."""

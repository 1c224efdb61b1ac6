"""One speculative method per module; ``registry.FACTORIES`` lists them."""

"""The HTTP routes, one module per family: ``chat``, ``completions``, ``admin`` (health, metrics, models...)."""

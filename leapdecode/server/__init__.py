"""OpenAI-compatible HTTP server (``leapdecode serve``): see :mod:`leapdecode.server.api_server`."""

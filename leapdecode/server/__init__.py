"""OpenAI-compatible HTTP server (``leapdecode serve``): the app is built by :mod:`leapdecode.server.api_server`
and run by :mod:`leapdecode.server.serve`."""

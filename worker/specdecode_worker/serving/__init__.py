"""Serving: the ``serve`` command and the OpenAI-compatible HTTP API over the engine."""

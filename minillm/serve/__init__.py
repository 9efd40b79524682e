"""Serving over HTTP: an OpenAI-compatible server in front of ``AsyncLLM``.

``python -m minillm.serve`` starts it (``__main__``); ``api_server`` holds the routes,
``protocol`` the request and response bodies, ``chat`` the chat template, ``metrics`` the
Prometheus ``/metrics``, ``background`` a server in a thread (for a notebook or a test),
``engine_process`` the engine in a process of its own (what ``python -m minillm.serve`` runs).
"""

from .api_server import build_app
from .background import BackgroundServer

__all__ = ["build_app", "BackgroundServer"]

"""A server running in a background thread of this process: for a notebook, a test, a benchmark.

with BackgroundServer(block_size=16, num_kv_blocks=256) as server:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    ...
    server.call(server.llm.engine_call(lambda e: e.stats()))   # read the same engine
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Awaitable, Optional

from ..async_llm import AsyncLLM


class BackgroundServer:
    """uvicorn on ``host:port`` (port 0: a free one) in a daemon thread, over one ``AsyncLLM``.

    ``model`` / ``**config_fields`` build the engine like ``LLM(...)``; or pass ``llm=AsyncLLM(...)``.
    ``engine_process=True``: the engine runs in a process of its own (``EngineProcessLLM``, what
    ``minillm serve`` runs), its compute threads on ``engine_cores`` if given; read it with
    ``engine_call``. By default it steps on a thread of this process, where ``llm.engine`` is the
    engine itself (what a notebook draws)."""

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        llm: Optional[AsyncLLM] = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: Optional[str] = None,
        model_name: Optional[str] = None,
        log_level: str = "warning",
        max_request_bytes: Optional[int] = None,
        engine_process: bool = False,
        engine_cores: Optional[set[int]] = None,
        **config_fields,
    ):
        from .__main__ import default_model_name

        if llm is None and engine_process:
            from .engine_process import EngineProcessLLM

            llm = EngineProcessLLM(model, engine_cores=engine_cores, **config_fields)
        self.llm = llm if llm is not None else AsyncLLM.from_config(model, **config_fields)
        self.model_path = self.llm.engine.model_path
        self.model_name = model_name or default_model_name(self.model_path)
        self.host, self.port, self.api_key, self.log_level = host, port, api_key, log_level
        self.max_request_bytes = max_request_bytes  # None: the server's default
        self._server = None
        self._thread: Optional[threading.Thread] = None
        self._stopped = False  # stop() shuts the engine down with the server
        self.loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Is the server's thread alive (False before ``start`` and after ``stop``)?"""
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        if self._stopped:
            raise RuntimeError(
                "BackgroundServer.start: this server was stopped, and its engine shut down with "
                "it; build a new BackgroundServer to serve again"
            )
        if self.running:
            raise RuntimeError(f"BackgroundServer.start: already serving on {self.url}")
        import uvicorn
        from .api_server import DEFAULT_MAX_REQUEST_BYTES, build_app

        app = build_app(
            self.llm,
            self.model_name,
            self.model_path,
            api_key=self.api_key,
            max_request_bytes=self.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=self.log_level, access_log=False, lifespan="on")
        self._server = uvicorn.Server(config)

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop
            loop.run_until_complete(self._server.serve(sockets=[sock]))
            loop.close()

        self._thread = threading.Thread(target=serve, name="minillm-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def call(self, coro: Awaitable, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's event loop (e.g. ``llm.engine_call(fn)``); its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def engine_call(self, fn, timeout: float = 60.0) -> Any:
        """``fn(engine)`` on the engine thread (or in the engine process), between two steps."""
        return self.call(self.llm.engine_call(fn), timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._stopped = True
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = self._thread = None

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

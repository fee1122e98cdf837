"""The stand-in OpenRouter server on a background thread of the test's own process (tests only)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.demo.openrouter_server import OpenRouterLikeServer, ServerConfig, start


@contextmanager
def serve_in_thread(cfg: ServerConfig, backend: Any) -> Iterator[tuple[str, OpenRouterLikeServer]]:
    """Run the server on a background thread's event loop; yields (base URL, server)."""
    server = OpenRouterLikeServer(cfg, backend)
    loop = asyncio.new_event_loop()
    ready: dict[str, Any] = {}
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            ready["runner"], ready["port"] = loop.run_until_complete(start(server))
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            ready["error"] = e
        started.set()
        if "error" not in ready:
            loop.run_forever()

    thread = threading.Thread(target=run, name="openrouter-server", daemon=True)
    thread.start()
    started.wait(30)
    if "error" in ready:
        raise ready["error"]
    try:
        yield f"http://{cfg.host}:{ready['port']}/api/v1", server
    finally:
        asyncio.run_coroutine_threadsafe(ready["runner"].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()

"""An HTTP server in a thread of this process, and whether an address reaches this machine only.

`BackgroundServer` runs an ASGI app with uvicorn in a daemon thread: the in-process retrieval
server of CPU runs, the code sandbox and retrieval actors under Ray, and the tests' real HTTP
servers. `is_loopback` is what the servers' bind checks ask (beyond loopback a key is needed).

Main entry points: `BackgroundServer`, `is_loopback`.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Any

import uvicorn


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (a name other than localhost counts
    as reachable: it may resolve to any address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False



class BackgroundServer:
    """Runs an ASGI app with uvicorn in a daemon thread of this process.

        with BackgroundServer(create_app(retriever)) as server:  # megarl.retrieval.server's app
            client = RetrievalClient(server.url)

    port 0 picks a free port; `sock` serves on an already bound socket instead.
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sock: socket.socket | None = None,
        log_level: str = "warning",
    ):
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        self._sock = sock
        self.host, self.port = sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        # log_config=None: leave the host process's logging configuration alone
        config = uvicorn.Config(app, log_level=log_level, log_config=None, access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"http-server-{self.port}", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as e:  # reported by start(); a daemon thread has no one else to tell
            self._error = e

    def start(self, timeout_s: float = 10.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"server on {self.url} stopped while starting: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"server on {self.url} did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

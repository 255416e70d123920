"""The daemon's HTTP endpoints: ``/metrics`` (Prometheus) and ``/healthz`` (readiness).

A stdlib WSGI server (``wsgiref``, a thread per request) runs in a daemon thread next to the
event loop; ``/metrics`` is prometheus-client's own WSGI app over the service's registry
(text format, OpenMetrics on request, gzip when accepted), ``/healthz`` answers from
:meth:`DaemonService.not_ready_reason`. The endpoints only read: nothing reaches the event loop.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from types import TracebackType
from typing import Any, Self
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import structlog
from prometheus_client import make_wsgi_app

from trainguard.daemon.service._metrics import DaemonMetrics

__all__ = ["HealthServer", "Readiness"]

log = structlog.get_logger("trainguard.daemon")

Readiness = Callable[[], str | None]
"""Why the daemon is not ready, or ``None`` when it is (``DaemonService.not_ready_reason``)."""

_StartResponse = Callable[..., Any]


def _text() -> list[tuple[str, str]]:
    # A new list per response: wsgiref adds Content-Length to the list it is given.
    return [("Content-Type", "text/plain; charset=utf-8")]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hung scrape never holds the process at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes come every few seconds: not worth a log line each."""


def _app(metrics: DaemonMetrics, readiness: Readiness) -> Callable[..., Iterable[bytes]]:
    serve_metrics = make_wsgi_app(metrics.registry)

    def app(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            result: Iterable[bytes] = serve_metrics(environ, start_response)
            return result
        if path == "/healthz":
            reason = readiness()
            if reason is None:
                start_response("200 OK", _text())
                return [b"ready\n"]
            start_response("503 Service Unavailable", _text())
            return [f"not ready: {reason}\n".encode()]
        start_response("404 Not Found", _text())
        return [b"not found: try /metrics or /healthz\n"]

    return app


class HealthServer:
    """Serves ``/metrics`` and ``/healthz`` on ``host:port`` from a background thread.

    Args:
        metrics: the metrics to expose.
        readiness: called per ``/healthz`` request, from the server's thread; must only read.
        host: address to bind (``127.0.0.1``, ``0.0.0.0``, ``::``, a host name).
        port: TCP port; 0 picks a free one (see :attr:`port`).

    Use as a context manager (``with HealthServer(...) as server:``), or call :meth:`start`
    and :meth:`close`. ``/healthz`` answers ``200 ready`` or ``503 not ready: <reason>``;
    other paths than ``/metrics`` and ``/healthz`` are 404.

    Raises:
        OSError: from :meth:`start`, when the address cannot be bound (in use, not local).
    """

    def __init__(
        self, metrics: DaemonMetrics, readiness: Readiness, *, host: str, port: int
    ) -> None:
        self._metrics = metrics
        self._readiness = readiness
        self._host = host
        self._port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the one picked when ``port`` was 0); needs :meth:`start`."""
        if self._server is None:
            raise RuntimeError("the server is not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server (IPv6 hosts in brackets)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Bind and serve from a daemon thread; logs ``metrics server listening``."""
        # WSGIServer binds IPv4 unless told otherwise; pick the host's family (as
        # prometheus-client's own start_http_server does).
        family = socket.getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0][0]
        server_class = type("_FamilyServer", (_Server,), {"address_family": family})
        self._server = make_server(
            self._host,
            self._port,
            _app(self._metrics, self._readiness),
            server_class=server_class,
            handler_class=_QuietHandler,
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="trainguard-http",
            daemon=True,
        )
        self._thread.start()
        log.info("metrics server listening", host=self._host, port=self.port, url=self.url)

    def close(self) -> None:
        """Stop serving and release the port (waits up to the 0.1 s poll interval)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

"""A worker's HTTP endpoint: ``/metrics`` for Prometheus, ``/healthz`` and ``/readyz`` for the
orchestrator, served from a daemon thread beside the stage."""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from streams.observe.health import WorkerHealth, probe, probe_body, process_health


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never keeps the worker from exiting


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # one line per scrape is noise
        pass


def serve(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0", health: WorkerHealth | None = None) -> int:
    """Serve ``registry`` at ``http://<addr>:<port>/metrics``, and ``/healthz`` and
    ``/readyz`` from ``health`` (default: the process's), from a daemon thread.

    ``port`` 0 lets the OS pick a free port. Returns the port bound. Raises ``OSError`` if
    the port is taken. The server lives as long as the process.
    """
    health = process_health() if health is None else health
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        answer = probe(health, environ.get("PATH_INFO", "/"))
        if answer is None:
            return metrics_app(environ, start_response)
        status, body = answer
        start_response("200 OK" if status == 200 else "503 Service Unavailable",
                       [("Content-Type", "application/json"), ("Cache-Control", "no-store")])
        return [probe_body(body)]

    server_cls = _Server6 if ":" in addr else _Server
    server = make_server(addr, port, app, server_class=server_cls, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="mmstream-metrics", daemon=True).start()
    return int(server.server_port)

"""/metrics and /healthz on a small HTTP port (stdlib server; the plugin is thread-based)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

HealthCheck = Callable[[], tuple[bool, str]]


def serve(
    address: str, port: int, registry: CollectorRegistry, health: HealthCheck
) -> ThreadingHTTPServer:
    """Start serving in a daemon thread; ``server.shutdown()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # stdlib naming
            if self.path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif self.path in ("/healthz", "/readyz"):
                ok, reason = health()
                self._send(200 if ok else 503, f"{reason}\n".encode(), "text/plain")
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # scrapes every few seconds are not news

    server = ThreadingHTTPServer((address, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server

"""A service that is up for the run's preflight and gone after it: it answers one ``GET /health`` with
``{"status": "ok"}`` and then closes its port, so every later call is refused (a crash after start)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        body = json.dumps({"status": "ok"}).encode()
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def gone_after_preflight() -> str:
    """The URL of a service that answers exactly one request, then stops listening."""
    srv = HTTPServer(("127.0.0.1", 0), _Health)

    def once() -> None:
        srv.handle_request()
        srv.server_close()

    threading.Thread(target=once, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}"

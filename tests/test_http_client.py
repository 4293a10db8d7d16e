"""The run's side of the services: every call is timed and counted, and an iteration drains its own."""

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest

from rlpipe import http_client
from tests.helpers.s3server import free_port


class _Half(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200 if self.path == "/ok" else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_calls_are_timed_counted_and_drained_per_service():
    srv = HTTPServer(("127.0.0.1", 0), _Half)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    http_client.drain()
    try:
        for path in ("/ok", "/ok", "/ok", "/fail"):
            http_client.post("verifier", url + path, json={}, timeout=5)
        with pytest.raises(httpx.ConnectError):  # refused: counted as an error, and still raised
            http_client.post("env", f"http://127.0.0.1:{free_port()}/step", json={}, timeout=5)
    finally:
        srv.shutdown()
    m = http_client.drain()
    assert m["service/verifier/calls"] == 4 and m["service/verifier/error_rate"] == 0.25
    assert 0 < m["service/verifier/latency_p50_s"] <= m["service/verifier/latency_p99_s"] < 5
    assert m["service/env/calls"] == 1 and m["service/env/error_rate"] == 1.0
    assert http_client.drain() == {}  # drained: the next iteration starts from nothing

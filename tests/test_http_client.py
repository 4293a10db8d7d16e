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


class _Flaky(BaseHTTPRequestHandler):
    """Answers each path with the status codes in ``plan[path]``, one per request, then 200."""

    plan: dict[str, list[int]] = {}

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        codes = self.plan.get(self.path, [])
        self.send_response(codes.pop(0) if codes else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_post_with_retries_retries_refusals_and_server_errors_but_not_a_wrong_request(monkeypatch):
    monkeypatch.setattr(http_client.time, "sleep", lambda s: None)
    _Flaky.plan = {"/busy": [429, 503], "/bad": [422], "/down": [503] * 5}
    srv = HTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        assert http_client.post_with_retries("verifier", url + "/busy", {}, 5, 2, "verifier service").status_code == 200
        with pytest.raises(http_client.NoAnswer) as bad:  # a 4xx other than 429 is final: no retry
            http_client.post_with_retries("verifier", url + "/bad", {}, 5, 2, "verifier service")
        with pytest.raises(http_client.NoAnswer) as down:
            http_client.post_with_retries("verifier", url + "/down", {}, 5, 2, "verifier service")
    finally:
        srv.shutdown()
    assert bad.value.status == "skipped" and "answered 422" in str(bad.value)
    assert down.value.status == "skipped" and str(down.value).startswith("verifier service answered 503")
    assert _Flaky.plan["/down"] == [503, 503]  # 1 try + 2 retries took three of the five

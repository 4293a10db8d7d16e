"""Prefect's API clients share one TLS context per CA file (flows/_tls.py), verifying what they did before."""

from __future__ import annotations

import shutil
import ssl

import certifi
import pytest

import flows  # noqa: F401  (patches on import)
from flows import _tls


@pytest.fixture
def counted(monkeypatch):
    """Counts the contexts really built; the cache starts empty."""
    built = []
    real = ssl.create_default_context

    def create(*a, **k):
        ctx = real(*a, **k)
        built.append(ctx)
        return ctx

    monkeypatch.setattr(ssl, "create_default_context", create)
    monkeypatch.setattr(_tls, "_contexts", {})
    return built


def _client_context(client) -> ssl.SSLContext:
    return client._client._transport._pool._ssl_context


def test_clients_share_one_context_per_ca_file(counted):
    from prefect.client.orchestration import PrefectClient, SyncPrefectClient

    assert set(_tls.share_tls_contexts()) == set(_tls.MODULES)  # idempotent, the pinned Prefect patched
    a = PrefectClient("http://127.0.0.1:9/api")
    b = PrefectClient("http://127.0.0.1:9/api")
    c = SyncPrefectClient("http://127.0.0.1:9/api")
    assert len(counted) == 1
    assert _client_context(a) is _client_context(b) is _client_context(c) is counted[0]
    assert counted[0].verify_mode == ssl.CERT_REQUIRED and counted[0].check_hostname


def test_insecure_and_verified_clients_keep_their_own_mode(counted):
    from prefect.client.orchestration import PrefectClient
    from prefect.settings import PREFECT_API_TLS_INSECURE_SKIP_VERIFY, temporary_settings

    with temporary_settings({PREFECT_API_TLS_INSECURE_SKIP_VERIFY: True}):
        loose = [_client_context(PrefectClient("https://127.0.0.1:9/api")) for _ in range(2)]
    strict = _client_context(PrefectClient("https://127.0.0.1:9/api"))
    assert loose[0] is loose[1] and loose[0].verify_mode == ssl.CERT_NONE and not loose[0].check_hostname
    assert strict is not loose[0] and strict.verify_mode == ssl.CERT_REQUIRED and strict.check_hostname
    assert len(counted) == 2


def test_a_changed_ca_file_is_read_again(counted, tmp_path):
    ca = tmp_path / "ca.pem"
    shutil.copy(certifi.where(), ca)
    first = _tls.shared_default_context(cafile=str(ca))
    assert _tls.shared_default_context(cafile=str(ca)) is first
    with ca.open("a") as f:
        f.write("\n")  # a rotated bundle: new size and mtime
    assert _tls.shared_default_context(cafile=str(ca)) is not first
    assert len(counted) == 2


def test_a_missing_ca_file_fails_as_ssl_does(counted, tmp_path):
    with pytest.raises(FileNotFoundError):
        _tls.shared_default_context(cafile=str(tmp_path / "gone.pem"))
    assert not _tls._contexts  # nothing cached for it


def test_the_proxy_is_the_ssl_module_otherwise():
    import prefect.client.orchestration as po

    assert po.ssl.create_default_context is _tls.shared_default_context
    assert po.ssl.SSLContext is ssl.SSLContext and po.ssl.CERT_NONE is ssl.CERT_NONE
    assert ssl.create_default_context is not _tls.shared_default_context  # nothing else in the process changes

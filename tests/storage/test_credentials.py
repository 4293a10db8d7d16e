"""S3 credentials against a real SeaweedFS: session tokens reach botocore and the wire, botocore's default chain
(a shared-credentials profile; a container-credentials endpoint, the path ECS/EKS Pod Identity take) reads and
writes for real, and no or bad credentials fail with the fix. EC2's instance metadata service is not run here.

SeaweedFS validates a session token (it refuses a request whose X-Amz-Security-Token it did not issue), so a
refused request with the token and an accepted one without it, same keys, shows the token went on the wire."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fsspec.asyn import sync

from rlpipe.config import settings
from rlpipe.storage import open_store
from rlpipe.storage import credentials as creds_mod
from rlpipe.storage.credentials import S3CredentialsError

_CLEARED = ("RLPIPE_S3_ACCESS_KEY_ID", "RLPIPE_S3_SECRET_ACCESS_KEY", "RLPIPE_S3_SESSION_TOKEN", "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN",
            "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN")


@pytest.fixture
def no_keys(monkeypatch, tmp_path):
    """No credentials anywhere botocore looks (and IMDS off, so a CI machine's own role cannot leak in)."""
    import s3fs

    for var in _CLEARED:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(creds_mod, "_resolved", {})
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec reuses a filesystem built from the same arguments
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def _endpoint_only(server) -> dict[str, str]:
    return {"RLPIPE_S3_ENDPOINT_URL": server.endpoint, "RLPIPE_S3_REGION": "us-east-1"}


def _signing_credentials(store):
    """The key id / secret / token the store's botocore client signs with."""
    store.fs.connect()
    return sync(store.fs.loop, store.fs.s3._get_credentials().get_frozen_credentials)


def test_a_session_token_reaches_botocore_and_the_request(s3_server, no_keys):
    env = s3_server.env() | {"RLPIPE_S3_SESSION_TOKEN": "rlpipe-session-token-1"}
    store = open_store(f"s3://{s3_server.bucket}/token", settings(env))
    signed = _signing_credentials(store)
    assert (signed.access_key, signed.token) == (s3_server.access_key, "rlpipe-session-token-1")
    with pytest.raises(PermissionError):  # SeaweedFS did not issue this token: it was sent, and checked
        store.put_bytes("x", b"1")
    plain = open_store(f"s3://{s3_server.bucket}/token", settings(s3_server.env()))
    assert _signing_credentials(plain).token is None
    plain.put_bytes("x", b"same keys, no token")
    assert plain.get_bytes("x") == b"same keys, no token"


def test_the_token_comes_from_the_same_source_as_the_keys():
    aws = settings({"AWS_ACCESS_KEY_ID": "ASIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t1"})
    assert (aws.s3_access_key_id, aws.s3_session_token, aws.s3_key_source) == ("ASIAEXAMPLE", "t1", "AWS_")
    # RLPIPE_S3_* keys are for another endpoint: the shell's AWS token must not ride along with them.
    mixed = settings({"RLPIPE_S3_ACCESS_KEY_ID": "k", "RLPIPE_S3_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t1",
                      "AWS_SECRET_ACCESS_KEY": "other"})
    assert (mixed.s3_secret_access_key, mixed.s3_session_token, mixed.s3_key_source) == ("s", None, "RLPIPE_S3_")
    own = settings({"RLPIPE_S3_ACCESS_KEY_ID": "k", "RLPIPE_S3_SECRET_ACCESS_KEY": "s", "RLPIPE_S3_SESSION_TOKEN": "t2"})
    assert own.s3_session_token == "t2"
    assert "t2" not in repr(own) and "t2" not in repr(creds_mod.resolve_s3_credentials(own))
    assert creds_mod.resolve_s3_credentials(own).describe == "key id k from RLPIPE_S3_ACCESS_KEY_ID with a session token"


def test_no_keys_uses_a_shared_credentials_profile(s3_server, no_keys, monkeypatch, tmp_path):
    """AWS_PROFILE in a credentials file: the botocore chain an instance profile also goes through."""
    path = tmp_path / "credentials"
    path.write_text(f"[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n[seaweed]\n"
                    f"aws_access_key_id = {s3_server.access_key}\naws_secret_access_key = {s3_server.secret_key}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(path))
    monkeypatch.setenv("AWS_PROFILE", "seaweed")
    s = settings(_endpoint_only(s3_server))
    assert s.s3_access_key_id is None
    described = creds_mod.resolve_s3_credentials(s).describe
    assert described == f"key id {s3_server.access_key} from botocore's default chain (shared-credentials-file)"
    store = open_store(f"s3://{s3_server.bucket}/profile", s)
    store.put_bytes("p", b"via AWS_PROFILE")
    assert store.get_bytes("p") == b"via AWS_PROFILE"


class _ContainerCredentials(ThreadingHTTPServer):
    """ECS/EKS Pod Identity's credentials endpoint: JSON keys for a request bearing the agreed Authorization."""

    def __init__(self, key: str, secret: str, token: str, auth: str):
        body = json.dumps({"AccessKeyId": key, "SecretAccessKey": secret, "Token": token,
                           "Expiration": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))})
        self.calls: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                outer.calls.append(self.headers.get("Authorization", ""))
                ok = self.headers.get("Authorization") == auth
                data = body.encode() if ok else b'{"message": "unauthorized"}'
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v2/credentials"


@pytest.mark.parametrize("token", ["", "container-session-token"])
def test_no_keys_uses_container_credentials(s3_server, no_keys, monkeypatch, token):
    """AWS_CONTAINER_CREDENTIALS_FULL_URI on loopback: botocore fetches keys (and a token) the way it does in ECS.
    An empty Token signs with the keys alone and SeaweedFS takes the write; a real token is sent (and refused,
    SeaweedFS never issued it)."""
    server = _ContainerCredentials(s3_server.access_key, s3_server.secret_key, token, auth="Bearer pod-identity")
    try:
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", server.url)
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", "Bearer pod-identity")
        s = settings(_endpoint_only(s3_server))
        described = creds_mod.resolve_s3_credentials(s).describe
        assert described.startswith(f"key id {s3_server.access_key} from botocore's default chain (container-role)")
        assert ("with a session token" in described) == bool(token) and s3_server.secret_key not in described
        store = open_store(f"s3://{s3_server.bucket}/container", s)
        signed = _signing_credentials(store)
        assert (signed.access_key, signed.token or "") == (s3_server.access_key, token)
        if token:
            with pytest.raises(PermissionError):
                store.put_bytes("c", b"1")
        else:
            store.put_bytes("c", b"via container credentials")
            assert store.get_bytes("c") == b"via container credentials"
        assert server.calls and set(server.calls) == {"Bearer pod-identity"}
    finally:
        server.shutdown()
        server.server_close()


def test_no_credentials_anywhere_names_what_was_tried_and_the_fix(s3_server, no_keys):
    with pytest.raises(S3CredentialsError) as e:
        open_store(f"s3://{s3_server.bucket}/none", settings(_endpoint_only(s3_server)))
    msg = str(e.value)
    for named in ("RLPIPE_S3_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID", "container credentials", "instance metadata",
                  "AWS_EC2_METADATA_DISABLED=true", "RLPIPE_S3_SESSION_TOKEN", "AWS_PROFILE"):
        assert named in msg, (named, msg)


def test_a_half_pair_of_keys_is_an_error(s3_server, no_keys):
    with pytest.raises(S3CredentialsError, match="RLPIPE_S3_ACCESS_KEY_ID is set but RLPIPE_S3_SECRET_ACCESS_KEY"):
        open_store(f"s3://{s3_server.bucket}/half", settings(_endpoint_only(s3_server) | {
            "RLPIPE_S3_ACCESS_KEY_ID": s3_server.access_key}))
    with pytest.raises(S3CredentialsError, match="AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID"):
        open_store(f"s3://{s3_server.bucket}/half", settings({"AWS_SECRET_ACCESS_KEY": "s"}))


def test_doctor_names_the_identity_by_key_id_and_a_bad_token_in_the_fix(s3_server, no_keys):
    from rlpipe.config import load_config
    from rlpipe.doctor import _Fail, _object_store

    cfg = load_config(None, [])
    env = s3_server.env() | {"RLPIPE_STORAGE_URI": f"s3://{s3_server.bucket}/doctor"}
    ok = _object_store(cfg, settings(env))
    assert f"as key id {s3_server.access_key} from RLPIPE_S3_ACCESS_KEY_ID: wrote" in ok
    with pytest.raises(_Fail) as e:
        _object_store(cfg, settings(env | {"RLPIPE_S3_SESSION_TOKEN": "expired-token-xyz"}))
    assert "with a session token" in e.value.detail and "RLPIPE_S3_SESSION_TOKEN" in e.value.fix
    for text in (ok, e.value.detail, e.value.fix):
        assert "expired-token-xyz" not in text and s3_server.secret_key not in text
    with pytest.raises(_Fail) as none:
        _object_store(cfg, settings(_endpoint_only(s3_server) | {"RLPIPE_STORAGE_URI": env["RLPIPE_STORAGE_URI"]}))
    assert "no usable S3 credentials" in none.value.detail and "instance profile" in none.value.fix

"""The object store's identities, against a real SeaweedFS: the runs' identity of `rlpipe up` (rlpipe.stack._s3)
and the sample infra/s3-identities.json may put, get and list in the bucket rlpipe and nothing else — no bucket
creation, no other bucket — and the stack's admin keys never reach the runs' variables."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from rlpipe import stack
from tests.helpers.s3server import free_port, weed_binary

pytestmark = pytest.mark.slow  # starts SeaweedFS

ROOT = Path(__file__).resolve().parents[2]


def _client(endpoint: str, access: str, secret: str):
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access, aws_secret_access_key=secret,
                        region_name="us-east-1", config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}))


def _code(call) -> str:
    with pytest.raises(ClientError) as e:
        call()
    return e.value.response["Error"]["Code"]


def _assert_bucket_scoped(scoped, admin) -> None:
    """``scoped`` works in rlpipe only; ``admin`` makes a second bucket to try it on."""
    scoped.put_object(Bucket="rlpipe", Key="runs/r1/x", Body=b"hello")
    assert scoped.get_object(Bucket="rlpipe", Key="runs/r1/x")["Body"].read() == b"hello"
    assert [o["Key"] for o in scoped.list_objects_v2(Bucket="rlpipe", Prefix="runs/")["Contents"]] == ["runs/r1/x"]

    assert _code(lambda: scoped.create_bucket(Bucket="rlpipe-other")) == "AccessDenied"
    admin.create_bucket(Bucket="elsewhere")
    admin.put_object(Bucket="elsewhere", Key="secret", Body=b"not yours")
    assert _code(lambda: scoped.get_object(Bucket="elsewhere", Key="secret")) == "AccessDenied"
    assert _code(lambda: scoped.list_objects_v2(Bucket="elsewhere")) == "AccessDenied"
    assert _code(lambda: scoped.put_object(Bucket="elsewhere", Key="y", Body=b"1")) == "AccessDenied"
    assert _code(lambda: scoped.delete_bucket(Bucket="elsewhere")) == "AccessDenied"
    assert "elsewhere" not in {b["Name"] for b in scoped.list_buckets()["Buckets"]}


def test_stack_gives_runs_a_bucket_scoped_identity(tmp_path):
    d = tmp_path / "stack"
    d.mkdir()
    c, env, admin = stack._s3(d)
    ident = json.loads((d / "s3-identities.json").read_text())
    assert oct((d / "s3-identities.json").stat().st_mode & 0o777) == "0o600"
    actions = {i["name"]: i["actions"] for i in ident["identities"]}
    assert actions == {"rlpipe-admin": ["Admin"], "rlpipe": ["Read:rlpipe", "Write:rlpipe", "List:rlpipe", "Tagging:rlpipe"]}
    # The admin pair is in none of the runs' variables, nor in what `up` writes for them.
    assert admin.access_key not in json.dumps(env) and admin.secret_key not in json.dumps(env)
    assert admin.secret_key not in repr(admin)
    stack._record(d, [c], env)
    for f in ("env.sh", "stack.json"):
        text = (d / f).read_text()
        assert env["RLPIPE_S3_SECRET_ACCESS_KEY"] in text and admin.secret_key not in text and admin.access_key not in text

    stack._start(c, d, env)
    try:
        assert not stack._bucket_ready(env)  # the runs' identity alone cannot make the bucket it needs
        stack._wait([c], env, 120, admin)  # up's way: the admin makes it, the runs' identity writes
        assert stack._bucket_ready(env)  # status's way afterwards: no admin needed
        endpoint = env["RLPIPE_S3_ENDPOINT_URL"]
        _assert_bucket_scoped(_client(endpoint, env["RLPIPE_S3_ACCESS_KEY_ID"], env["RLPIPE_S3_SECRET_ACCESS_KEY"]),
                              _client(endpoint, admin.access_key, admin.secret_key))
    finally:
        stack._stop([c], grace_s=3)


def _serve(tmp_path: Path, identities: dict) -> tuple[str, str, subprocess.Popen]:
    """weed with ``identities`` on free loopback ports; (S3 endpoint, master address for weed shell, process)."""
    (tmp_path / "ids.json").write_text(json.dumps(identities))
    (tmp_path / "data").mkdir()
    ports = {k: free_port() for k in ("master", "master.port.grpc", "volume", "volume.port.grpc", "filer",
                                       "filer.port.grpc", "s3", "s3.port.grpc")}
    cmd = [weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={tmp_path / 'data'}", "-s3",
           f"-s3.config={tmp_path / 'ids.json'}", "-volume.max=20", "-master.volumeSizeLimitMB=64",
           "-volume.preStopSeconds=0", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-metricsPort={free_port()}",
           *(f"-{k if '.' in k else k + '.port'}={v}" for k, v in ports.items())]
    log = (tmp_path / "weed.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    # "host:port.grpcPort": weed shell would otherwise assume the gRPC port is port + 10000 (compose's defaults).
    return f"http://127.0.0.1:{ports['s3']}", f"127.0.0.1:{ports['master']}.{ports['master.port.grpc']}", proc


def test_sample_identity_is_bucket_scoped_and_needs_its_keys_replaced(tmp_path, monkeypatch):
    sample = json.loads((ROOT / "infra" / "s3-identities.json").read_text())
    (ident,) = sample["identities"]
    assert ident["actions"] == list(stack.SCOPED_ACTIONS)  # the same identity as `rlpipe up` gives runs
    assert not any(a == "Admin" or a.startswith("Admin:") for a in ident["actions"])
    (cred,) = ident["credentials"]
    assert cred["accessKey"].startswith("REPLACE-ME") and cred["secretKey"].startswith("REPLACE-ME")

    # Keys replaced, as infra/make-compose-secrets.sh does; a test-only admin identity makes a second bucket.
    cred.update(accessKey="sample-access", secretKey="sample-secret")
    sample["identities"].append({"name": "test-admin", "credentials": [{"accessKey": "adm", "secretKey": "adm-secret"}],
                                 "actions": ["Admin"]})
    endpoint, master, proc = _serve(tmp_path, sample)
    try:
        scoped, admin = _client(endpoint, "sample-access", "sample-secret"), _client(endpoint, "adm", "adm-secret")
        for _ in range(120):  # S3 API (and so master and filer) up
            try:
                admin.list_buckets()
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.5)
        # The bucket is made the way infra/README.md and the compose stack's s3-init make it: no S3 key at all.
        # weed shell exits 0 whatever happens, so its output says whether it worked.
        out = subprocess.run([weed_binary(), "shell", f"-master={master}"], input="s3.bucket.create -name rlpipe\n",
                             capture_output=True, text=True, timeout=60).stdout
        assert "created bucket rlpipe" in out, out + (tmp_path / "weed.log").read_text()[-2000:]
        for _ in range(120):  # volumes writable, not just the API
            try:
                scoped.put_object(Bucket="rlpipe", Key="_ready", Body=b"1")
                break
            except ClientError:
                time.sleep(0.5)
        _assert_bucket_scoped(scoped, admin)

        # The compose stack's clients: no RLPIPE_S3_* keys, botocore's shared-credentials file instead.
        from rlpipe.config import settings
        from rlpipe.storage import open_store

        creds = tmp_path / "s3-credentials"
        creds.write_text("[default]\naws_access_key_id = sample-access\naws_secret_access_key = sample-secret\n")
        for var in ("RLPIPE_S3_ACCESS_KEY_ID", "RLPIPE_S3_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                    "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
        s = settings({"RLPIPE_S3_ENDPOINT_URL": endpoint, "RLPIPE_S3_REGION": "us-east-1", "RLPIPE_HOME": str(tmp_path)})
        assert s.s3_access_key_id is None
        store = open_store("s3://rlpipe/store", s)
        store.put_bytes("probe/x", b"via the credentials file")
        assert store.get_bytes("probe/x") == b"via the credentials file"
    finally:
        proc.terminate()
        try:
            proc.wait(3)  # weed takes ~15 s to stop gracefully; its data is thrown away
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

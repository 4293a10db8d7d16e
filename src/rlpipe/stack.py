"""``rlpipe up`` / ``status`` / ``down``: the long-lived local stack as background processes.

``up`` starts, on 127.0.0.1 and each on a free port: SeaweedFS's S3 server (a bucket ``rlpipe``; runs get a
fresh key pair that may read, write, list and tag in that bucket only, see :func:`_s3`), an MLflow tracking
server, a Prefect server and a process worker on the pool ``rlpipe-local``, and the rlpipe services the config
needs (the verifier service; the reward-model service for ``reward.type: model``; the environment service for agent runs; ``rollout_replicas``
rollout services; the trainer service with ``trainer_ranks`` ranks). Every component gets a log and a pid in ``$RLPIPE_HOME/stack/``, its own
``RLPIPE_HOME`` where it is an rlpipe process, and is health-checked before ``up`` returns; when one
fails, what was started is stopped again and the error names the component and its log. ``stack.json``
records what ``up`` started (``down`` stops exactly that, by PID) and ``env.sh`` the variables that point
runs at it. Core code: the orchestrator is started as a program, never imported.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlpipe.config import RunConfig, Settings
from rlpipe.net import free_port

__all__ = ["StackError", "down", "status", "up"]

BUCKET = "rlpipe"
# What the runs' S3 identity may do: SeaweedFS's bucket-scoped actions. No Admin: it cannot create or
# delete buckets, nor touch another bucket. (infra/s3-identities.json is the same identity as a sample.)
SCOPED_ACTIONS = tuple(f"{action}:{BUCKET}" for action in ("Read", "Write", "List", "Tagging"))


class StackError(RuntimeError):
    """A component did not come up; the message names it and its log."""


@dataclass
class Component:
    name: str
    cmd: list[str]
    health: str  # URL answering 200 once it is up ("s3:" + endpoint for the object store)
    url: str
    env: dict[str, str] = field(default_factory=dict)
    pid: int | None = None
    log: str = ""


def _bin(name: str) -> str:
    found = Path(sys.executable).with_name(name)
    if not found.exists():
        raise StackError(f"{found} is missing: install rlpipe's dependencies (make install)")
    return str(found)


def stack_dir(s: Settings) -> Path:
    return (s.home / "stack").resolve()


def _rlpipe(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from rlpipe.cli import main; sys.argv = ['rlpipe'] + sys.argv[1:]; main()", *args]


@dataclass(frozen=True)
class S3Admin:
    """The object store's admin key pair. Only ``up`` holds it, to make the bucket (:func:`_bucket_ready`); it is
    in no component's environment, nor in ``env.sh`` or ``stack.json`` (SeaweedFS reads it from its 0600
    identity file)."""

    access_key: str
    secret_key: str = field(repr=False)


def _s3(d: Path) -> tuple[Component, dict[str, str], S3Admin]:
    """The S3 server with two identities: ``rlpipe`` (fresh keys, :data:`SCOPED_ACTIONS` only), whose keys are
    the runs' variables, and ``rlpipe-admin``, returned apart so that it never reaches them."""
    access, secret = f"rlpipe-{secrets.token_hex(4)}", secrets.token_urlsafe(24)
    admin = S3Admin(f"rlpipe-admin-{secrets.token_hex(4)}", secrets.token_urlsafe(24))
    ident = d / "s3-identities.json"
    ident.touch(mode=0o600)
    ident.chmod(0o600)  # before the keys go in
    ident.write_text(json.dumps({"identities": [
        {"name": "rlpipe-admin", "credentials": [{"accessKey": admin.access_key, "secretKey": admin.secret_key}],
         "actions": ["Admin"]},
        {"name": "rlpipe", "credentials": [{"accessKey": access, "secretKey": secret}], "actions": list(SCOPED_ACTIONS)},
    ]}))
    ports = {k: free_port() for k in ("master", "master.port.grpc", "volume", "volume.port.grpc", "filer",
                                       "filer.port.grpc", "s3", "s3.port.grpc")}
    (d / "s3-data").mkdir(exist_ok=True)
    cmd = [_bin("weed"), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={d / 's3-data'}", "-s3",
           f"-s3.config={ident}", "-volume.max=20", "-master.volumeSizeLimitMB=256", "-volume.preStopSeconds=0",
           "-s3.port.iceberg=0", "-s3.port.lance=0",  # fixed default ports (8181, 9101): a second weed would clash
           f"-metricsPort={free_port()}",
           *(f"-{k if '.' in k else k + '.port'}={v}" for k, v in ports.items())]
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    env = {"RLPIPE_STORAGE_URI": f"s3://{BUCKET}/store", "RLPIPE_S3_ENDPOINT_URL": endpoint,
           "RLPIPE_S3_ACCESS_KEY_ID": access, "RLPIPE_S3_SECRET_ACCESS_KEY": secret, "RLPIPE_S3_REGION": "us-east-1",
           # Long-lived keys of this SeaweedFS: a session token left in the shell is for another store.
           "RLPIPE_S3_SESSION_TOKEN": ""}
    return Component("s3", cmd, f"s3:{endpoint}", endpoint), env, admin


def _core(d: Path) -> tuple[list[Component], dict[str, str], S3Admin]:
    """The object store, MLflow and Prefect, the variables that point at them, and the store's admin keys."""
    s3, env, admin = _s3(d)
    mlflow_port, prefect_port = free_port(), free_port()
    mlflow = Component("mlflow", [_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
                                  "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}",
                                  "--artifacts-destination", str(d / "mlartifacts"), "--workers", "1"],
                       f"http://127.0.0.1:{mlflow_port}/health", f"http://127.0.0.1:{mlflow_port}")
    prefect = Component("prefect", [_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
                        f"http://127.0.0.1:{prefect_port}/api/health", f"http://127.0.0.1:{prefect_port}",
                        env={"PREFECT_HOME": str(d / "prefect")})
    env |= {"RLPIPE_TRACKING_URI": mlflow.url, "PREFECT_API_URL": f"{prefect.url}/api",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return [s3, mlflow, prefect], env, admin


def _services(config: RunConfig, d: Path, rollout_replicas: int, trainer_ranks: int = 0) -> tuple[list[Component], dict[str, str]]:
    """The worker and the rlpipe services the config needs, and the variables that point runs at them."""
    out, env = [], {}
    port = free_port()
    out.append(Component("worker", [_bin("prefect"), "worker", "start", "--pool", "rlpipe-local", "--type", "process",
                                    "--with-healthcheck"], f"http://127.0.0.1:{port}/health", "pool rlpipe-local",
                         env={"PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1", "PREFECT_WORKER_WEBSERVER_PORT": str(port)}))
    wanted = [("verifier", "RLPIPE_VERIFIER_URL", ["serve", "verifier"])]
    if config.reward.type == "model":
        wanted.append(("reward-model", "RLPIPE_REWARD_MODEL_URL", ["serve", "reward-model", config.reward_model_spec]))
    if config.agent is not None:
        wanted.append(("env", "RLPIPE_ENV_URL", ["serve", "env"]))
    lora = config.train.lora  # adapter syncs need replicas that serve LoRA (a trainer service sends merged weights)
    lora_args = (["--lora-rank", str(lora.r)] if lora and config.rollout.lora_sync == "adapter"
                 and config.rollout.engine == "vllm" and not trainer_ranks else [])
    wanted += [(f"rollout-{k}", "RLPIPE_ROLLOUT_URL", ["serve", "rollout", config.task.policy_model,
                                                       "--engine", config.rollout.engine, *lora_args])
               for k in range(rollout_replicas)]
    if trainer_ranks:
        wanted.append(("trainer", "RLPIPE_TRAINER_URL", ["serve", "trainer", "--nproc", str(trainer_ranks)]))
    for name, var, args in wanted:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        out.append(Component(name, _rlpipe(*args, "--port", str(port)), f"{url}/health", url,
                             env={"RLPIPE_HOME": str(d / name / "home")}))
        env[var] = f"{env[var]},{url}" if var in env else url
    return out, env


def _start(c: Component, d: Path, env: dict[str, str]) -> None:
    log = d / f"{c.name}.log"
    c.log = str(log)
    with log.open("w") as f:
        proc = subprocess.Popen(c.cmd, env=os.environ | env | c.env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=d)
    c.pid = proc.pid
    (d / f"{c.name}.pid").write_text(str(proc.pid))


def _healthy(c: Component, env: dict[str, str], admin: S3Admin | None = None) -> bool:
    import httpx

    if c.health.startswith("s3:"):
        return _bucket_ready(env, admin)
    try:
        return httpx.get(c.health, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _bucket_ready(env: dict[str, str], admin: S3Admin | None = None) -> bool:
    """The S3 API answers and its volumes take a write from the runs' identity. With ``admin`` (``up``), the
    bucket is made first, on the first try that works: the runs' identity may not create buckets."""
    import boto3
    from botocore.config import Config

    def client(access: str, secret: str):
        return boto3.client("s3", endpoint_url=env["RLPIPE_S3_ENDPOINT_URL"], aws_access_key_id=access,
                            aws_secret_access_key=secret, region_name="us-east-1",
                            config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}))

    try:
        if admin is not None:
            adm = client(admin.access_key, admin.secret_key)
            if BUCKET not in {b["Name"] for b in adm.list_buckets().get("Buckets", [])}:
                adm.create_bucket(Bucket=BUCKET)
        runs = client(env["RLPIPE_S3_ACCESS_KEY_ID"], env["RLPIPE_S3_SECRET_ACCESS_KEY"])
        runs.put_object(Bucket=BUCKET, Key="_ready", Body=b"1")
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


def _wait(components: list[Component], env: dict[str, str], timeout_s: float, admin: S3Admin | None = None) -> None:
    pending, deadline = list(components), time.monotonic() + timeout_s
    while pending:
        for c in list(pending):
            if _pid_alive(c.pid) and _healthy(c, env, admin):
                pending.remove(c)
            elif not _pid_alive(c.pid):
                raise StackError(f"{c.name} exited at start; its log {c.log}:\n{_tail(c.log)}")
        if pending and time.monotonic() > deadline:
            c = pending[0]
            raise StackError(f"{c.name} not healthy at {c.health} after {timeout_s:g} s; its log {c.log}:\n{_tail(c.log)}")
        time.sleep(0.5)


def _tail(path: str, n: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # reap it when it is our child and has exited
        if waited == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped by a parent that is not us) is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def up(config: RunConfig, s: Settings, rollout_replicas: int = 0, trainer_ranks: int = 0,
       timeout_s: float = 180.0) -> dict[str, Any]:
    """Start the stack (refused while one recorded in this RLPIPE_HOME is still running); returns stack.json."""
    d = stack_dir(s)
    if (d / "stack.json").exists() and any(c["alive"] for c in status(s)):
        raise StackError(f"a stack is already running from {d}: `rlpipe status` shows it, `rlpipe down` stops it")
    d.mkdir(parents=True, exist_ok=True)
    core, env, admin = _core(d)
    started: list[Component] = []
    try:
        for c in core:
            _start(c, d, env)
            started.append(c)
        _record(d, started, env)
        _wait(core, env, timeout_s, admin)
        _work_pool(env, d)
        services, svc_env = _services(config, d, rollout_replicas, trainer_ranks)
        env |= svc_env
        for c in services:
            _start(c, d, env)
            started.append(c)
        _record(d, started, env)
        _wait(services, env, timeout_s)
    except BaseException:
        _stop(started)
        (d / "stack.json").unlink(missing_ok=True)
        raise
    return _record(d, started, env)


def _work_pool(env: dict[str, str], d: Path) -> None:
    got = subprocess.run([_bin("prefect"), "work-pool", "create", "rlpipe-local", "--type", "process"], capture_output=True,
                         text=True, env=os.environ | env | {"PREFECT_HOME": str(d / "prefect")}, timeout=120)
    if got.returncode != 0 and "already exists" not in (got.stdout + got.stderr):
        raise StackError(f"prefect work-pool create rlpipe-local failed:\n{(got.stdout + got.stderr)[-2000:]}")


def _record(d: Path, started: list[Component], env: dict[str, str]) -> dict[str, Any]:
    stack = {"components": [asdict(c) | {"env": {}} for c in started], "env": env, "dir": str(d)}
    (d / "stack.json").write_text(json.dumps(stack, indent=1))
    (d / "stack.json").chmod(0o600)  # it holds the S3 keys
    (d / "env.sh").write_text("".join(f"export {k}={v}\n" for k, v in sorted(env.items())))
    (d / "env.sh").chmod(0o600)
    return stack


def _read(s: Settings) -> dict[str, Any]:
    path = stack_dir(s) / "stack.json"
    if not path.exists():
        raise StackError(f"no stack recorded in {path.parent}: start one with `rlpipe up`")
    return json.loads(path.read_text())


def status(s: Settings) -> list[dict[str, Any]]:
    """Every recorded component: name, pid, url, log, alive (process), healthy (its health check)."""
    stack = _read(s)
    out = []
    for c in stack["components"]:
        comp = Component(**c)
        alive = _pid_alive(comp.pid)
        out.append({"name": comp.name, "pid": comp.pid, "url": comp.url, "log": comp.log, "alive": alive,
                    "healthy": alive and _healthy(comp, stack["env"])})
    return out


def _stop(components: list[Component], grace_s: float = 15.0) -> list[str]:
    """SIGTERM each component's process group (each was started as its own session), then SIGKILL."""
    stopped = []
    for c in reversed(components):
        if not _pid_alive(c.pid):
            continue
        try:
            os.killpg(c.pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + grace_s
        while _pid_alive(c.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _pid_alive(c.pid):
            os.killpg(c.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _pid_alive(c.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        stopped.append(c.name)
    return stopped


def down(s: Settings) -> list[str]:
    """Stop exactly what ``up`` recorded, by PID; returns the names stopped."""
    d = stack_dir(s)
    stack = _read(s)
    stopped = _stop([Component(**c) for c in stack["components"]])
    for c in stack["components"]:
        (d / f"{c['name']}.pid").unlink(missing_ok=True)
    (d / "stack.json").unlink()
    return stopped

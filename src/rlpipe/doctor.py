"""``rlpipe doctor``: is every component a config uses reachable and working? One line each, with the fix.

Each check does the real thing on a small scale: the object store writes, reads back and deletes a probe
object; MLflow lists experiments and registered models (and resolves the policy's ``models:/`` alias);
the Prefect API answers ``/health``; the rollout engine starts and generates a few tokens; the services
in ``RLPIPE_VERIFIER_URL`` / ``RLPIPE_REWARD_MODEL_URL`` / ``RLPIPE_ENV_URL`` answer ``/health``; the
sandbox reports its isolation level against the config's floor; DeepSpeed imports; a GPU is named; the
enabled GPU alert rules get the GPU metrics they read (else: which rule is not evaluated, and why).

A check that does not apply (no GPU, no service configured) is ``skip``, never a failure. Every check runs
with a deadline, so one hung component cannot hang the report. Runs start with the same checks
(``preflight``), but for the engine and an in-process verifier pool, which their own start proves moments later.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rlpipe.config import RunConfig, Settings

__all__ = ["Check", "PreflightError", "run_checks", "format_check", "preflight"]


@dataclass
class Check:
    component: str
    status: str  # ok | fail | skip
    detail: str
    fix: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class PreflightError(RuntimeError):
    """A component a run needs is down; the message names each one and its fix."""


class _Fail(Exception):
    def __init__(self, detail: str, fix: str):
        super().__init__(detail)
        self.detail, self.fix = detail, fix


class _Skip(Exception):
    pass


def _object_store(cfg: RunConfig, s: Settings) -> str:
    from rlpipe.storage.credentials import S3CredentialsError, resolve_s3_credentials
    from rlpipe.storage.store import open_store

    uri = s.resolve_storage_uri(cfg)
    fix = (f"start the S3 server behind {s.s3_endpoint_url or 'the default AWS endpoint'} or fix RLPIPE_S3_ENDPOINT_URL "
           "and the keys (RLPIPE_S3_ACCESS_KEY_ID / RLPIPE_S3_SECRET_ACCESS_KEY, and RLPIPE_S3_SESSION_TOKEN for "
           "temporary credentials: a token that is wrong or expired is refused), or unset them to use botocore's "
           "chain (AWS_PROFILE, instance profile, container credentials)" if uri.startswith("s3://")
           else f"make {uri} a writable folder, or set RLPIPE_STORAGE_URI / storage.uri")
    key, data, who = f"_doctor/{uuid.uuid4().hex}.txt", os.urandom(64), ""
    try:
        if uri.startswith("s3://"):  # the identity by its key id only: never the secret or the token
            who = f" as {resolve_s3_credentials(s).describe}"
        store = open_store(uri, s)
        store.put_bytes(key, data)
        back = store.get_bytes(key)
        store.delete(key)
    except S3CredentialsError as e:  # its message names what was tried and the fix
        raise _Fail(f"{uri}: no usable S3 credentials", str(e)) from None
    except Exception as e:  # noqa: BLE001 - every failure of the store is this component's
        raise _Fail(f"{uri}{who}: {type(e).__name__}: {str(e)[:200]}", fix) from None
    if back != data:
        raise _Fail(f"{uri}: read back {len(back)} bytes that differ from the {len(data)} written", fix)
    return f"{uri}{who}: wrote, read back and deleted a probe object"


def _mlflow_client(cfg: RunConfig, s: Settings):
    from mlflow.tracking import MlflowClient

    uri = s.resolve_tracking_uri(cfg)
    return MlflowClient(tracking_uri=uri, registry_uri=uri), uri


def _mlflow_tracking(cfg: RunConfig, s: Settings) -> str:
    try:
        client, uri = _mlflow_client(cfg, s)
        n = len(client.search_experiments(max_results=5))
    except Exception as e:  # noqa: BLE001
        raise _Fail(f"{s.resolve_tracking_uri(cfg)}: {type(e).__name__}: {str(e)[:200]}",
                    "start the MLflow server (mlflow server --host 127.0.0.1) or fix RLPIPE_TRACKING_URI / tracking.uri") from None
    return f"{uri}: answers ({n} experiment(s) listed)"


def _mlflow_registry(cfg: RunConfig, s: Settings) -> str:
    from rlpipe.training.models import resolve_source

    client, uri = _mlflow_client(cfg, s)
    store = s.resolve_storage_uri(cfg)
    if uri.startswith(("http://", "https://")) and cfg.tracking.register_models and not store.startswith("s3://"):
        raise _Fail(f"{uri} is an MLflow server and checkpoints go to the local folder {store}: the server refuses "
                    "to register a version whose source is a local path",
                    "store checkpoints in S3 (RLPIPE_STORAGE_URI=s3://…; `rlpipe up` sets it), or set "
                    "tracking.register_models=false") from None
    try:
        client.search_registered_models(max_results=5)
    except Exception as e:  # noqa: BLE001
        raise _Fail(f"{uri}: {type(e).__name__}: {str(e)[:200]}", "use a tracking URI with a model registry "
                    "(sqlite:///… or an MLflow server with a database backend)") from None
    spec = cfg.task.policy_model
    if not spec.startswith("models:/"):
        return f"{uri}: answers; the policy is {spec!r} (not from the registry)"
    try:
        source = resolve_source(spec, s, cfg)
    except Exception as e:  # noqa: BLE001
        raise _Fail(f"{spec}: {str(e)[:200]}", "register it first (rlpipe sft CONFIG, or the sft deployment, registers NAME@base), "
                    "or point task.policy_model at a registered version") from None
    return f"{spec} → {source}"


def _http_health(url: str, what: str, fix: str) -> str:
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/health", timeout=5.0)
    except httpx.HTTPError as e:
        raise _Fail(f"{what} at {url}: {type(e).__name__}: {str(e)[:160] or 'no answer'}", fix) from None
    if r.status_code != 200:
        raise _Fail(f"{what} at {url}: /health answered HTTP {r.status_code}: {r.text[:160]}", fix)
    return f"{url}: /health ok"


def _prefect_api(cfg: RunConfig, s: Settings) -> str:
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise _Skip("PREFECT_API_URL is not set: each run starts its own temporary Prefect server")
    health = _http_health(url, "Prefect API", "start it (prefect server start) or unset PREFECT_API_URL")
    return f"{health}; {_alert_automations(url)}"


def _alert_automations(url: str) -> str:
    """Whether an enabled automation on the server acts on rlpipe's alert events (not a failure when none does:
    alerts still reach MLflow, the log and the event feed)."""
    import httpx

    try:
        autos = httpx.post(url.rstrip("/") + "/automations/filter", json={}, timeout=5.0).json()
        acting = [a["name"] for a in autos if a.get("enabled") and
                  any(str(e).startswith("rlpipe.alert") for e in (a.get("trigger") or {}).get("expect") or [])]
    except (httpx.HTTPError, ValueError, TypeError, KeyError) as e:
        return f"automations unreadable ({type(e).__name__})"
    if not acting:
        return "no automation acts on rlpipe alerts (install them: rlpipe automations install)"
    return f"{len(acting)} automation(s) act on rlpipe alerts ({', '.join(sorted(acting))})"


def _policy_dir(cfg: RunConfig, s: Settings, tmp: str) -> str:
    from rlpipe.training.models import fetch_source, load_model, resolve_source

    if cfg.task.policy_model != "tiny":
        return str(fetch_source(resolve_source(cfg.task.policy_model, s, cfg), s))
    from rlpipe.training.checkpoint import save_checkpoint

    model, tok, _ = load_model("tiny", cfg, s)
    save_checkpoint(tmp, model, tok, trainer_state={"kind": "doctor"})
    return tmp


def _rollout_engine(cfg: RunConfig, s: Settings) -> str:
    import tempfile

    from rlpipe.rollout.base import SamplingConfig
    from rlpipe.rollout.engines import new_engine

    engine = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            start = time.perf_counter()
            engine = new_engine(cfg.rollout.engine, _policy_dir(cfg, s, tmp), max_model_len=64, seed=cfg.seed)
            started = time.perf_counter() - start
            out = engine.generate([[1, 2, 3]], SamplingConfig(n=1, temperature=0.0, max_new_tokens=4))
        except Exception as e:  # noqa: BLE001
            raise _Fail(f"{cfg.rollout.engine}: {type(e).__name__}: {str(e)[:200]}",
                        "check the policy checkpoint and the engine's install (make install); "
                        "rollout.engine: hf runs without vLLM") from None
        finally:
            if engine is not None:
                engine.close()
    n = len(out[0][0].token_ids) if out and out[0] else 0
    return f"{cfg.rollout.engine}: started in {started:.1f} s, a probe generation gave {n} token(s)"


def _services(cfg: RunConfig, s: Settings) -> list[tuple[str, Callable[[RunConfig, Settings], str]]]:
    """The service checks this config needs: a remote service's /health, else the in-process part."""
    out: list[tuple[str, Callable[[RunConfig, Settings], str]]] = []
    if cfg.agent is None and cfg.reward.type != "model":
        out.append(("verifier", _verifier))
    if cfg.reward.type == "model":
        out.append(("reward-model", lambda c, st: _remote_or_local(st.reward_model_url, "reward-model service",
                                                                  "RLPIPE_REWARD_MODEL_URL", "scored in-process")))
    if cfg.agent is not None:
        out.append(("environment", _environment))
    if s.trainer_url:
        out.append(("trainer", lambda c, st: _http_health(st.trainer_url, "trainer service",
                                                          "start it (rlpipe serve trainer) or unset services.trainer / RLPIPE_TRAINER_URL")))
    return out


def _rollout_replicas(cfg: RunConfig, s: Settings) -> str:
    """Every rollout replica's /health: a failure when none answers; a run goes on with fewer (their share
    goes to the others), so a dead one is named but not a failure."""
    fix = "start it (rlpipe serve rollout) or drop it from services.rollout / RLPIPE_ROLLOUT_URL"
    up, down = [], []
    for url in s.rollout_urls:
        try:
            up.append(_http_health(url, "rollout replica", fix))
        except _Fail as e:
            down.append(e.detail)
    if not up:
        raise _Fail("no rollout replica answers: " + "; ".join(down), fix)
    return f"{len(up)} of {len(s.rollout_urls)} replica(s) answer" + (f"; DOWN (their prompts go to the others): {'; '.join(down)}"
                                                                      if down else "")


def _verifier(cfg: RunConfig, s: Settings) -> str:
    """The service's /health, or the in-process pool started and asked for one verdict with a known answer."""
    if s.verifier_url:
        return _http_health(s.verifier_url, "verifier service", "start it (rlpipe serve verifier) or unset RLPIPE_VERIFIER_URL")
    from rlpipe.rewards.pool import VerifierPool, VerifyItem

    with VerifierPool(workers=1, grace_s=cfg.reward.grace_s, plugins=tuple(cfg.reward.plugins)) as pool:
        got = pool.score([VerifyItem("math", "The answer is 42.", "42")])[0]
    if got.status != "ok" or got.reward != 1.0:
        raise _Fail(f"in-process pool: a known-correct answer got status {got.status!r}, reward {got.reward} ({got.reason})",
                    "check reward.plugins and the verifier install (rlpipe verifier audit on the labelled cases)")
    return f"in-process pool: a worker process started and judged a known answer correct ({cfg.reward.workers} in runs)"


def _remote_or_local(url: str | None, what: str, var: str, local: str) -> str:
    if url is None:
        raise _Skip(f"{local} ({var} is not set)")
    return _http_health(url, what, f"start it (rlpipe serve …) or unset {var} to run in-process")


def _environment(cfg: RunConfig, s: Settings) -> str:
    if s.env_url:
        return _http_health(s.env_url, "environment service", "start it (rlpipe serve env) or unset RLPIPE_ENV_URL")
    spec = cfg.agent.spec()
    env = spec.make()
    task = env.draw(0) if hasattr(env, "draw") else {}
    try:
        obs = env.reset(task, 0)
    except Exception as e:  # noqa: BLE001
        raise _Fail(f"{spec.env}: reset failed: {type(e).__name__}: {str(e)[:160]}", "check agent.env's params") from None
    return f"{spec.env} in-process ({cfg.agent.executor}): reset gave {obs[:40]!r}"


def _sandbox(cfg: RunConfig, s: Settings) -> str:
    from rlpipe.rewards.guards import SandboxFloorError, check_sandbox_floor, sandboxed_verifiers
    from rlpipe.sandbox import isolation_report

    level = isolation_report()["level"]
    runs_code = sandboxed_verifiers([cfg.reward.verifier, *cfg.reward.weights])
    if cfg.agent is not None and cfg.agent.executor == "sandbox":
        runs_code.append("agent.executor: sandbox")
    try:
        check_sandbox_floor(level, cfg.reward.required_sandbox_components(), "this machine")
    except SandboxFloorError as e:
        if runs_code:
            raise _Fail(f"level {level!r} for {', '.join(runs_code)}", str(e)) from None
        return f"level {level!r}, below reward.sandbox_min_level; this config runs no model code in the sandbox"
    return f"level {level!r}" + (f" for {', '.join(runs_code)}" if runs_code else "")


def _deepspeed(cfg: RunConfig, s: Settings) -> str:
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except Exception as e:  # noqa: BLE001
        raise _Fail(f"import failed: {type(e).__name__}: {str(e)[:160]}", "make install (DeepSpeed is pinned in "
                    "requirements/lock-*.txt)") from None
    return f"deepspeed {deepspeed.__version__} on {get_accelerator().device_name()}"


def _gpu(cfg: RunConfig, s: Settings) -> str:
    import torch

    if not torch.cuda.is_available():
        raise _Skip("no CUDA GPU: training and rollout run on the CPU")
    free, total = torch.cuda.mem_get_info(0)
    return (f"{torch.cuda.device_count()} × {torch.cuda.get_device_name(0)}, "
            f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free on GPU 0")


# The GPU alert rules and the metrics they read (rlpipe.tracking.resources), which a CPU run does not have.
GPU_ALERTS = {"gpu_memory_growth": "resource/gpu_mem_peak_bytes/*", "gpu_util_low": "resource/gpu<i>_util"}


def _alert_inputs(cfg: RunConfig, s: Settings) -> str:
    """Whether the enabled alert rules will get their inputs here: the GPU rules need CUDA (and pynvml), the
    mismatch rule a sampler on the trainer's policy. A rule without them is left out of every iteration's
    evaluation, which must be said once rather than pass as a rule that stays quiet."""
    rules = [r for r in GPU_ALERTS if getattr(cfg.alerts, r).enabled]
    missing = [f"alerts.{r} ({why}: no {GPU_ALERTS[r]} metrics)" for r, why in _gpu_rules_unfed(rules).items()]
    if cfg.alerts.mismatch.enabled and cfg.rollout.async_steps:
        missing.append(f"alerts.mismatch (rollout.async_steps: {cfg.rollout.async_steps}: the sampler's policy is "
                       "that many updates behind the trainer's, so the log-prob gap measures those updates, not the "
                       "engine; mismatch/* is still logged)")
    if missing:
        raise _Skip("not evaluated in this run: " + "; ".join(missing))
    if not rules:
        raise _Skip("no GPU alert rule enabled")
    return "alerts " + ", ".join(f"{r} on {GPU_ALERTS[r]}" for r in rules)


def _gpu_rules_unfed(rules: list[str]) -> dict[str, str]:
    """The GPU alert rules of ``rules`` that this machine cannot feed, and why."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return {r: "no CUDA GPU" for r in rules}
    if "gpu_util_low" in rules and importlib.util.find_spec("pynvml") is None:
        return {"gpu_util_low": "pynvml is not installed: pip install nvidia-ml-py"}
    return {}


def _started_by_the_run(cfg: RunConfig, s: Settings) -> str:
    raise _Skip("in-process pool: the run starts it, and stops if it cannot")


def _plan(cfg: RunConfig, s: Settings, engine: bool, local_pool: bool) -> list[tuple[str, Callable[[RunConfig, Settings], str]]]:
    """The checks in order; preflight leaves out what the run's own start proves (``engine``, ``local_pool``)."""
    checks = [("object-store", _object_store), ("mlflow-tracking", _mlflow_tracking), ("mlflow-registry", _mlflow_registry),
              ("prefect-api", _prefect_api)]
    if s.rollout_urls:
        checks.append(("rollout-service", _rollout_replicas))
    elif engine:
        checks.append(("rollout-engine", _rollout_engine))
    services = [(n, _started_by_the_run if n == "verifier" and not local_pool and not s.verifier_url else fn)
                for n, fn in _services(cfg, s)]
    return checks + services + [("sandbox", _sandbox), ("deepspeed", _deepspeed), ("gpu", _gpu),
                                ("alert-inputs", _alert_inputs)]


def _one(name: str, fn: Callable[[RunConfig, Settings], str], cfg: RunConfig, s: Settings, timeout_s: float) -> Check:
    """Run one check in a daemon thread (a hung component must hold neither the report nor the exit)."""
    start, box = time.perf_counter(), {}

    def target() -> None:
        try:
            box["detail"] = fn(cfg, s)
        except BaseException as e:  # noqa: BLE001 - a check's own crash is that component's failure
            box["error"] = e

    worker = threading.Thread(target=target, name=f"doctor-{name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    took = time.perf_counter() - start
    if worker.is_alive():
        return Check(name, "fail", f"no answer in {timeout_s:g} s", "is it up and reachable? see its log", took)
    e = box.get("error")
    if isinstance(e, _Fail):
        return Check(name, "fail", e.detail, e.fix, took)
    if isinstance(e, _Skip):
        return Check(name, "skip", str(e), seconds=took)
    if e is not None:
        return Check(name, "fail", f"{type(e).__name__}: {str(e)[:200]}", "see the message", took)
    return Check(name, "ok", box["detail"], seconds=took)


def run_checks(cfg: RunConfig, s: Settings, engine: bool = True, timeout_s: float = 120.0,
               progress: Callable[[Check], None] | None = None, local_pool: bool = True) -> list[Check]:
    """Every check this config needs, in order; ``progress`` sees each result as it comes."""
    out, s = [], s.for_run(cfg)
    for name, fn in _plan(cfg, s, engine, local_pool):
        check = _one(name, fn, cfg, s, timeout_s)
        out.append(check)
        if progress:
            progress(check)
    return out


def format_check(c: Check) -> str:
    mark = {"ok": "ok  ", "fail": "FAIL", "skip": "skip"}[c.status]
    line = f"{mark}  {c.component:<16} {c.detail}  ({c.seconds:.1f} s)"
    return line + (f"\n      fix: {c.fix}" if c.fix else "")


def preflight(cfg: RunConfig, s: Settings, timeout_s: float = 60.0) -> list[Check]:
    """The doctor's checks but the engine and an in-process verifier pool (the run's start proves both);
    :class:`PreflightError` on any failure."""
    checks = run_checks(cfg, s, engine=False, timeout_s=timeout_s, local_pool=False)
    failed = [c for c in checks if c.status == "fail"]
    if failed:
        raise PreflightError("preflight failed — " + "; ".join(f"{c.component}: {c.detail} (fix: {c.fix})" for c in failed))
    return checks

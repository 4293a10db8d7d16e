"""An environment run in the sandbox: every call in its own sandboxed process, killed at a deadline.

:func:`sandboxed_env` gives an environment that answers the environment protocol like the environment it wraps, but each
``reset`` and each ``step`` runs the environment in a fresh :func:`rlpipe.sandbox.run_python` process
(no network, CPU time, memory and wall-clock limits, a private file system; see
:mod:`rlpipe.sandbox`). The process is stateless: a step replays the episode from ``reset(task, seed)``
through the actions so far, then applies the new one. Environments are deterministic given the task,
the seed and the actions (the protocol asks it), so the replay rebuilds the same state — and it is
*checked*: each replayed observation must equal the one the episode saw, or the step is the
environment's error ("not deterministic under replay"). Statelessness is what lets any service
replica serve any step, and a restarted service lose no episode.

The price is replay work, quadratic in the episode's steps; for tool environments (microseconds a
step) it is lost in the process start (~0.1–0.3 s). Each step has ``step_timeout_s``: the step call is
interrupted by a timer inside the sandbox, and the sandbox's wall clock (the replay's steps, the new
one and the start-up allowance) kills the process if the step ignores it. A step that runs past its
deadline, a crash, or a sandbox failure raises :class:`EnvFailure`, which the episode turns into
status ``error`` — never a reward of 0.

No network by default; ``allow_hosts`` lets the environment reach exactly those ``host:port`` pairs
through :func:`rlpipe.envs.net.connect` and an allow-list proxy on the host (:mod:`rlpipe.envs.net`).

The sandbox sees rlpipe's environment code and its pure-Python dependencies read-only at
``/opt/rlpipe/lib`` (and ``plugins``, modules that register more environments, at
``/opt/rlpipe/plugins``); it runs them with the system interpreter, as the sandbox runs all code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

from rlpipe import http_client
from rlpipe.envs.base import StepResult
from rlpipe.envs.spec import EnvSpec

_LIB, _PLUGINS, _NET = "/opt/rlpipe/lib", "/opt/rlpipe/plugins", "/opt/rlpipe/net"
_DEPENDENCIES = ("pydantic", "pydantic_core", "annotated_types", "typing_extensions", "typing_inspection")
_STARTUP_S = 10.0  # what an interpreter start and the imports may take on a loaded machine


class EnvFailure(RuntimeError):
    """The environment failed (crashed, hung past its step deadline, broke its sandbox's limits);
    ``kind`` is ``timeout`` for a deadline, ``unavailable`` for an environment service that did not
    answer, else ``error``."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


# The program run in the sandbox. The request is on stdin; one JSON line comes back on stdout.
_RUNNER = r'''
import json, signal, sys, time
req = json.loads(sys.stdin.read())
sys.path[:0] = req["path"]
import importlib, os
if req["net"]:
    import rlpipe.envs.net as net
    net.SOCKET = next(p for p in req["net"] if os.path.exists(p))
for mod in req["plugins"]:
    importlib.import_module(mod)
from rlpipe.envs.base import StepResult
from rlpipe.envs.spec import EnvSpec

class StepTimeout(Exception):
    pass

def _alarm(signum, frame):
    raise StepTimeout()

signal.signal(signal.SIGALRM, _alarm)

def timed(fn, *args):
    signal.setitimer(signal.ITIMER_REAL, req["step_timeout_s"])
    t0 = time.perf_counter()
    try:
        return fn(*args), time.perf_counter() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)

def out(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()

where = "reset"
try:
    env = EnvSpec.model_validate(req["spec"]).make()
    obs, env_s = timed(env.reset, req["task"], req["seed"])
    if not isinstance(obs, str):
        raise TypeError(f"reset returned {type(obs).__name__}, not an observation string")
    if req["seen"] and req["seen"][0] != obs:
        raise AssertionError("reset gave another first observation than the episode saw: not deterministic under replay")
    result = {"observation": obs, "env_s": env_s}
    for k, action in enumerate(req["actions"]):
        where = f"step {k + 1}"
        r, env_s = timed(env.step, action)
        if not isinstance(r, StepResult):
            raise TypeError(f"returned {type(r).__name__}, not a StepResult")
        if k + 1 < len(req["seen"]) and req["seen"][k + 1] != r.observation:
            raise AssertionError("replay gave another observation than the episode saw: not deterministic under replay")
        result = {"observation": r.observation, "reward": r.reward, "done": r.done, "info": r.info, "env_s": env_s}
    out(ok=True, **result)
except StepTimeout:
    out(ok=False, kind="timeout", error=f"{where} ran past step_timeout_s={req['step_timeout_s']:g}")
except BaseException as e:
    out(ok=False, kind="error", error=f"{where} failed: {type(e).__name__}: {e}")
'''


def _module_path(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"{name!r} cannot be found; environments need it inside the sandbox")
    origin = Path(spec.origin)
    return origin.parent if origin.name == "__init__.py" else origin


@dataclass(frozen=True)
class SandboxOptions:
    """Limits of each sandboxed call (see :class:`rlpipe.sandbox.SandboxLimits`) and the step deadline."""

    step_timeout_s: float = 10.0
    cpu_s: float = 10.0
    memory_mb: int = 512
    plugins: tuple[str, ...] = ()
    allow_hosts: tuple[str, ...] = ()  # "host:port" the environment may reach through rlpipe.envs.net.connect

    def binds(self) -> list[tuple[str, str]]:
        """Host paths the sandbox sees read-only: rlpipe, its environment dependencies, the plugins."""
        import rlpipe

        lib = _readable_copy(tuple([Path(rlpipe.__file__).parent, *map(_module_path, _DEPENDENCIES)]))
        out = [(str(lib), _LIB)]
        if self.plugins:
            out.append((str(_readable_copy(tuple(map(_module_path, self.plugins)))), _PLUGINS))
        if self.allow_hosts:
            out.append((_proxy(self.allow_hosts).dir, _NET))
        return out


_PROXIES: dict[tuple[str, ...], Any] = {}


def _proxy(allow: tuple[str, ...]):
    """The allow-list proxy of these hosts (one per process and list, started on first use)."""
    from rlpipe.envs.net import AllowListProxy

    if allow not in _PROXIES:
        _PROXIES[allow] = AllowListProxy(allow)
    return _PROXIES[allow]


_COPIES: dict[tuple[Path, ...], Path] = {}


def _readable_copy(paths: tuple[Path, ...]) -> Path:
    """A copy of ``paths`` (modules or packages) in a fresh folder the sandbox's unprivileged uid can
    read — bubblewrap opens bind sources as that uid, and a virtual environment under ``/root`` is not
    readable to it. Made once per process; owned by this process's user, read-only to everyone else."""
    import atexit
    import shutil
    import tempfile

    if paths not in _COPIES:
        root = Path(tempfile.mkdtemp(prefix="rlpipe-envlib-"))
        for p in paths:
            if p.is_dir():
                shutil.copytree(p, root / p.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(p, root / p.name)
        import compileall

        compileall.compile_dir(str(root), quiet=2, workers=1)  # the sandbox reads bytecode, never writes it
        for d, _, files in os.walk(root):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644 if not f.endswith(".so") else 0o755)
        atexit.register(shutil.rmtree, root, True)
        _COPIES[paths] = root
    return _COPIES[paths]


def sandbox_call(request: dict[str, Any], options: SandboxOptions) -> dict[str, Any]:
    """Run one replay request (``spec``, ``task``, ``seed``, ``actions``, ``seen``) in a fresh sandbox;
    the reply of its last call (``observation``, and after a step ``reward``, ``done``, ``info``; ``env_s``)
    or :class:`EnvFailure`."""
    from rlpipe.sandbox import SandboxLimits, run_python

    binds = options.binds()
    actions = request["actions"]
    full = request | {"path": [_LIB, _PLUGINS] + [h for h, _ in binds],  # sandbox paths, else the host's
                      "plugins": [_module_path(m).stem for m in options.plugins], "step_timeout_s": options.step_timeout_s,
                      "net": [f"{_NET}/net.sock", f"{_proxy(options.allow_hosts).dir}/net.sock"] if options.allow_hosts else []}
    wall = _STARTUP_S + options.step_timeout_s * (len(actions) + 1)
    limits = SandboxLimits(wall_s=wall, cpu_s=options.cpu_s, memory_mb=options.memory_mb)
    res = run_python(_RUNNER, stdin=json.dumps(full), limits=limits, ro_binds=binds)
    what = f"{request['spec'].get('env')} {f'step {len(actions)}' if actions else 'reset'}"
    lines = res.stdout.strip().splitlines()
    if res.status != "ok" or not lines:
        tail = (res.stderr or "").strip().splitlines()[-1:] or [""]
        raise EnvFailure(f"{what}: sandbox {res.status} (exit {res.exit_code}, {res.isolation}) {tail[0]}".rstrip(),
                         "timeout" if res.status == "timeout" else "error")
    try:
        reply = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise EnvFailure(f"{what}: the sandboxed environment wrote no result ({lines[-1][:80]!r})") from None
    if not reply.get("ok"):
        raise EnvFailure(f"{what}: {reply.get('error')}", reply.get("kind", "error"))
    return reply


@dataclass
class ReplayEnv:
    """One episode of ``spec``'s environment whose every call is a stateless replay request answered by
    ``call`` (:func:`sandbox_call` here, or the environment service over HTTP): reset, then the actions."""

    spec: EnvSpec
    call: Callable[[dict[str, Any]], dict[str, Any]]
    task: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    actions: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    last_env_s: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.env

    @property
    def version(self) -> str:
        from rlpipe.envs.spec import env_class

        return env_class(self.spec.env).version

    def reset(self, task: dict[str, Any], seed: int) -> str:
        self.task, self.seed, self.actions, self.seen = dict(task), int(seed), [], []
        obs = self._run([])["observation"]
        self.seen.append(obs)
        return obs

    def step(self, action: str) -> StepResult:
        if not self.seen:
            raise RuntimeError(f"{self.name}: step() before reset()")
        r = self._run(self.actions + [action])
        self.actions.append(action)
        self.seen.append(r["observation"])
        return StepResult(r["observation"], r.get("reward", 0.0), bool(r.get("done")), r.get("info") or {})

    def _run(self, actions: list[str]) -> dict[str, Any]:
        reply = self.call({"spec": self.spec.model_dump(mode="json"), "task": self.task, "seed": self.seed,
                           "actions": actions, "seen": self.seen})
        self.last_env_s = float(reply.get("env_s", 0.0))
        return reply


def sandboxed_env(spec: EnvSpec, options: SandboxOptions | None = None) -> ReplayEnv:
    """An episode of ``spec`` whose every call runs in its own sandbox on this machine."""
    opts = options or SandboxOptions()
    return ReplayEnv(spec, lambda req: sandbox_call(req, opts))


def http_call(url: str, timeout_s: float = 60.0, retries: int = 3) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Replay requests answered by the environment service at ``url`` (``rlpipe serve env``): a 429 is
    retried with backoff; a service that is down, refuses or is slow raises :class:`EnvFailure`
    (``unavailable``), so the episode is ``error`` — counted, never a reward of 0."""
    base = url.rstrip("/")

    def call(request: dict[str, Any]) -> dict[str, Any]:
        import httpx

        path = "/step" if request["actions"] else "/reset"
        delay = 0.25
        for attempt in range(retries + 1):
            try:
                r = http_client.post("env", base + path, json=request, timeout=timeout_s)
            except httpx.HTTPError as e:
                raise EnvFailure(f"environment service {base}{path}: {type(e).__name__}: {e}", "unavailable") from None
            if r.status_code == 429 and attempt < retries:
                time.sleep(delay)
                delay *= 2
                continue
            if r.status_code != 200:
                raise EnvFailure(f"environment service {base}{path}: HTTP {r.status_code} {r.text[:300]}",
                                 "unavailable" if r.status_code in (429, 502, 503, 504) else "error")
            reply = r.json()
            if reply.get("failed"):
                raise EnvFailure(reply.get("reason", "failed"), reply.get("kind", "error"))
            return reply
        raise AssertionError("unreachable")

    return call


def remote_env(spec: EnvSpec, url: str, timeout_s: float = 60.0) -> ReplayEnv:
    """An episode of ``spec`` whose every call the environment service at ``url`` answers."""
    return ReplayEnv(spec, http_call(url, timeout_s))

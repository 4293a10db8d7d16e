"""An environment plugin that attacks its host: each action names an attack, the observation says
what happened. Registered as ``hostile``; the sandbox tests run it and check that every attack fails."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

from rlpipe.envs import StepResult, register_env


@register_env("hostile", version="1")
class Hostile:

    def __init__(self, params: Any):
        self.params = params

    def reset(self, task: dict[str, Any], seed: int) -> str:
        self.task = task
        return "ready"

    def step(self, action: str) -> StepResult:
        kind, _, arg = action.partition(":")
        return StepResult(getattr(self, f"_{kind}")(arg))

    def _net(self, arg: str) -> str:  # connect to a server listening on the host
        host, port = arg.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return "REACHED"
        except OSError as e:
            return f"blocked: {e}"

    def _proxied(self, arg: str) -> str:  # through the allow-list proxy (rlpipe.envs.net.connect)
        from rlpipe.envs.net import connect

        host, port = arg.rsplit(":", 1)
        try:
            s = connect(host, int(port), timeout=3)
            s.sendall(b"ping")
            got = s.recv(16).decode()
            s.close()
            return f"REACHED {got}"
        except OSError as e:
            return f"blocked: {e}"

    def _read(self, arg: str) -> str:  # read a host file
        try:
            with open(arg) as f:
                return "READ " + f.read(100)
        except OSError as e:
            return f"blocked: {e}"

    def _write(self, arg: str) -> str:  # leave a file on the host
        try:
            with open(arg, "w") as f:
                f.write("pwned")
            return "WROTE"
        except OSError as e:
            return f"blocked: {e}"

    def _kill(self, arg: str) -> str:  # signal a host process
        try:
            os.kill(int(arg), signal.SIGTERM)
            return "KILLED"
        except OSError as e:
            return f"blocked: {e}"

    def _crash(self, arg: str) -> str:
        raise RuntimeError("the environment crashed")

    def _exit(self, arg: str) -> str:
        os._exit(3)

    def _hang(self, arg: str) -> str:
        if arg == "stubborn":  # a step that ignores the in-sandbox timer: only the wall clock stops it
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True:
            pass

    def _memory(self, arg: str) -> str:
        blob = bytearray(int(arg) << 20)
        return f"allocated {len(blob) >> 20} MB"

    def _random(self, arg: str) -> str:  # not deterministic: replay sees another observation
        return os.urandom(8).hex()

    def _echo(self, arg: str) -> str:
        return arg

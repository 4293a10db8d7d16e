"""Rollout engines behind HTTP (``rlpipe serve rollout``), driven through the same :class:`RolloutEngine`
interface as an in-process engine, so that one iteration flow serves both.

:class:`RemoteEngine` is one replica. Weights reach it only through the object store: ``load_weights``
uploads the folder's ``*.safetensors`` to ``runs/<run>/weights/<sha256[:16]>/`` and asks the replica to
load them with their expected hash, which it checks before and after the reload; once every replica
holds them, the earlier uploads are deleted.
:class:`ReplicatedEngine` splits the prompts of a request across replicas in consecutive blocks (prompt ``i`` keeps
the seed ``seed + i`` it has in-process on vLLM) and moves a dead replica's share to the live ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlpipe import http_client
from rlpipe.rollout.base import Completion, SamplingConfig, WeightSyncError

log = logging.getLogger(__name__)

__all__ = ["RemoteEngine", "ReplicaDown", "ReplicatedEngine", "upload_weights"]


class ReplicaDown(ConnectionError):
    """A rollout replica did not answer, or answered with a server error."""


def upload_weights(store: Any, run_id: str, folder: str | Path) -> tuple[str, str]:
    """The folder's weights in the store (once per content): (their URI, their sha256)."""
    from rlpipe.storage.weights import file_weights_sha256

    sha = file_weights_sha256(folder)
    key = f"runs/{run_id}/weights/{sha[:16]}"
    files = sorted(Path(folder).glob("*.safetensors"))
    if sorted(Path(k).name for k in store.list(key)) != [f.name for f in files]:
        for f in files:
            store.put_bytes(f"{key}/{f.name}", f.read_bytes())
    return store.url(key), sha


class RemoteEngine:
    """One rollout replica at ``url``."""

    def __init__(self, url: str, store: Any, run_id: str, timeout_s: float = 600.0):
        self.url, self.store, self.run_id, self.timeout_s = url.rstrip("/"), store, run_id, timeout_s
        self.name = f"rollout@{self.url}"
        h = self.health()
        self._dtype, self._sha = str(h["dtype"]), str(h["version"])
        self.last_readback = 0

    def health(self) -> dict[str, Any]:
        import httpx

        try:
            r = httpx.get(f"{self.url}/health", timeout=10.0)
        except httpx.HTTPError as e:
            raise ReplicaDown(f"rollout replica {self.url}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise ReplicaDown(f"rollout replica {self.url}: /health answered HTTP {r.status_code}")
        return r.json()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        try:
            r = http_client.post("rollout", f"{self.url}{path}", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise ReplicaDown(f"rollout replica {self.url}{path}: {type(e).__name__}: {e}") from None
        if r.status_code >= 500 or r.status_code == 429:
            raise ReplicaDown(f"rollout replica {self.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        if r.status_code != 200:  # the request itself is wrong: no other replica would take it either
            raise ValueError(f"rollout replica {self.url}{path} refused the request: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        out = self._post("/generate", {"prompts": prompts, "n": sampling.n, "temperature": sampling.temperature,
                                       "top_p": sampling.top_p, "max_new_tokens": sampling.max_new_tokens,
                                       "seed": sampling.seed})
        self._sha = out["version"]
        return [[Completion(c["token_ids"], c["logprobs"], c["text"], c["finish_reason"]) for c in o]
                for o in out["completions"]]

    def sequence_logprobs(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[float]]:
        return self._post("/logprobs", {"prompts": prompts, "continuations": continuations})["logprobs"]

    def load_weights(self, folder: str | Path) -> str:
        uri, sha = upload_weights(self.store, self.run_id, folder)
        return self.load_uri(uri, sha)

    def load_uri(self, uri: str, sha: str) -> str:
        got = self._post("/weights", {"uri": uri, "sha256": sha})
        self._sha, self.last_readback = got["version"], int(got.get("tensors", 0))
        return self._sha

    @property
    def dtype(self) -> str:
        return self._dtype

    def weights_sha256(self) -> str:
        return self._sha

    def close(self) -> None:  # the service outlives the run
        pass


class ReplicatedEngine:
    """Several replicas as one engine: a request's prompts are split across the live ones; a replica
    that fails is left out from then on and its share is redone on the others."""

    def __init__(self, replicas: list[RemoteEngine]):
        if not replicas:
            raise ValueError("no rollout replica: give at least one URL")
        self.replicas, self.dead = list(replicas), set()
        self.name = f"rollout×{len(replicas)}"
        self.rerouted = 0  # prompts moved off a dead replica, over the engine's life

    def live(self) -> list[RemoteEngine]:
        alive = [r for r in self.replicas if r.url not in self.dead]
        if not alive:
            raise ReplicaDown(f"every rollout replica is down: {', '.join(sorted(self.dead))}")
        return alive

    def _down(self, replica: RemoteEngine, err: Exception) -> None:
        log.warning("rollout replica %s is down (%s); its prompts go to the others", replica.url, err)
        self.dead.add(replica.url)

    def _each(self, call: Callable[[RemoteEngine], Any]) -> dict[str, Any]:
        """``call``'s answer from every live replica, by URL; one that is down is left out from then on."""
        out = {}
        for replica in self.live():
            try:
                out[replica.url] = call(replica)
            except ReplicaDown as e:
                self._down(replica, e)
        return out

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        results: dict[int, list[Completion]] = {}
        todo = list(range(len(prompts)))
        while todo:
            live = self.live()
            size = -(-len(todo) // len(live))
            chunks = [todo[k * size:(k + 1) * size] for k in range(len(live))]
            with ThreadPoolExecutor(len(live)) as pool:
                futs = [(r, idx, pool.submit(self._chunk, r, prompts, idx, sampling)) for r, idx in zip(live, chunks) if idx]
            todo = []
            for replica, idx, fut in futs:
                try:
                    results.update(zip(idx, fut.result()))
                except ReplicaDown as e:
                    self._down(replica, e)
                    self.rerouted += len(idx)
                    todo += idx
            todo.sort()
        return [results[i] for i in range(len(prompts))]

    @staticmethod
    def _chunk(replica: RemoteEngine, prompts: list[list[int]], idx: list[int], sampling: SamplingConfig):
        """One request per run of consecutive prompts, seeded ``seed + first index``: prompt i samples with
        ``seed + i`` as it does in-process (vLLM seeds each prompt of a request apart), whatever the split."""
        outs, runs = [], []
        for i in idx:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            s = sampling if sampling.seed is None else SamplingConfig(**{**sampling.__dict__, "seed": sampling.seed + run[0]})
            outs += replica.generate([prompts[i] for i in run], s)
        return outs

    def sequence_logprobs(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[float]]:
        """The first live replica's (every replica holds the same weights: each sync proves it)."""
        for replica in self.live():
            try:
                return replica.sequence_logprobs(prompts, continuations)
            except ReplicaDown as e:
                self._down(replica, e)
        return self.sequence_logprobs(prompts, continuations)  # raises: none left

    def load_weights(self, folder: str | Path) -> str:
        uri, sha = upload_weights(self.live()[0].store, self.live()[0].run_id, folder)
        held = self.load_uri(uri, sha)
        self._prune(uri)
        return held

    def load_uri(self, uri: str, sha: str) -> str:
        """Every live replica loads the weights under ``uri`` (checked against ``sha``); the version they hold."""
        held = self._each(lambda replica: replica.load_uri(uri, sha))
        if not held:
            self.live()  # raises: every replica is down
        if len(set(held.values())) != 1:
            raise WeightSyncError(f"rollout replicas hold different weights after the reload: {held}")
        return next(iter(held.values()))

    def _prune(self, current_uri: str) -> None:
        """Every replica holds the new weights: the earlier uploads are nobody's any more."""
        store = self.replicas[0].store
        current = store.key_of(current_uri)
        prefix = current.rsplit("/", 1)[0]
        for old in {"/".join(k.split("/")[:4]) for k in store.list(prefix)} - {current}:
            store.delete(old)

    def probe_each(self, prompts: list[list[int]], continuations: list[list[int]]) -> dict[str, list[list[float]]]:
        """Every live replica's log-probs on the probe: each one's sync is proven, not only the first's."""
        out = self._each(lambda replica: replica.sequence_logprobs(prompts, continuations))
        return out or self.probe_each(prompts, continuations)  # raises when none is left

    @property
    def dtype(self) -> str:
        return self.live()[0].dtype

    def weights_sha256(self) -> str:
        return self.live()[0].weights_sha256()

    @property
    def last_readback(self) -> int:
        return self.live()[0].last_readback

    def close(self) -> None:
        pass

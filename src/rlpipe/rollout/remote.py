"""Rollout engines behind HTTP (``rlpipe serve rollout``), driven through the same :class:`RolloutEngine`
interface as an in-process engine, so that one iteration flow serves both.

:class:`RemoteEngine` is one replica. The trainer's weights reach it over HTTP, with no object store between:
``load_tensors`` cuts them into safetensors buckets (:mod:`rlpipe.storage.weight_stream`) and streams them to
the replica's ``/weights/stream/…`` endpoints with their sha256, which the replica checks on what it received
before the reload (the transfer's proof) and the engine's read-back checks after. ``load_weights(folder)``
reads the folder and streams the same way. ``load_uri`` remains for weights already in the run's store (the
trainer service's upload): the replica downloads those itself.
:class:`ReplicatedEngine` splits the prompts of a request across replicas in consecutive blocks (prompt ``i`` keeps
the seed ``seed + i`` it has in-process on vLLM) and moves a dead replica's share to the live ones. It encodes
each bucket of a weight sync once and streams them to every live replica in parallel (:class:`Buckets`).

A replica started with LoRA support (``rlpipe serve rollout --lora-rank R``) takes a LoRA adapter alone instead
(``load_adapter``: megabytes in one body, :func:`adapter_body`) and serves its base weights with it; the
replicated engine sends it to every live replica in parallel and requires that all read the same adapter.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlpipe import http_client
from rlpipe.rollout.base import Completion, Digest, SamplingConfig, WeightSyncError, resolved
from rlpipe.storage.weight_stream import DEFAULT_BUCKET_BYTES

log = logging.getLogger(__name__)

__all__ = ["RemoteEngine", "ReplicaDown", "ReplicatedEngine", "adapter_body", "served_lora_ranks", "upload_weights"]


class ReplicaDown(ConnectionError):
    """A rollout replica did not answer, or answered with a server error."""


def upload_weights(store: Any, run_id: str, folder: str | Path) -> tuple[str, str]:
    """The folder's weights in the store (once per content): (their URI, their sha256), for ``load_uri``."""
    from rlpipe.storage.weights import file_weights_digest

    sha = file_weights_digest(folder)
    key = f"runs/{run_id}/weights/{sha[:16]}"
    files = sorted(Path(folder).glob("*.safetensors"))
    if sorted(Path(k).name for k in store.list(key)) != [f.name for f in files]:
        for f in files:
            store.put_bytes(f"{key}/{f.name}", f.read_bytes())
    return store.url(key), sha


def adapter_body(folder: str | Path) -> bytes:
    """A peft adapter folder (adapter_model.safetensors + adapter_config.json) as the one body ``POST /adapter``
    takes: the adapter's tensors as safetensors bytes, the config's text in their ``__metadata__``."""
    from safetensors.torch import load_file, save

    folder = Path(folder)
    weights, config = folder / "adapter_model.safetensors", folder / "adapter_config.json"
    if not weights.is_file() or not config.is_file():
        raise FileNotFoundError(f"{folder} is no LoRA adapter: it needs adapter_model.safetensors and adapter_config.json")
    return save(load_file(weights), metadata={"adapter_config": config.read_text()})


def _health(url: str) -> dict[str, Any]:
    """A replica's /health; ReplicaDown when it does not answer 200."""
    import httpx

    try:
        r = httpx.get(f"{url}/health", timeout=10.0)
    except httpx.HTTPError as e:
        raise ReplicaDown(f"rollout replica {url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise ReplicaDown(f"rollout replica {url}: /health answered HTTP {r.status_code}")
    return r.json()


def served_lora_ranks(urls: list[str] | tuple[str, ...]) -> dict[str, int]:
    """The LoRA rank each replica that answers serves adapters up to (0: none), by URL."""
    out = {}
    for url in urls:
        try:
            out[url] = int(_health(url.rstrip("/")).get("lora_rank") or 0)
        except ReplicaDown:
            continue  # a replica that is down is left out here as at the run's start
    return out


def _pieces(data: bytes, size: int = 1 << 20) -> Iterator[memoryview]:
    """``data`` in 1 MiB views, no copy: httpx sends one ``bytes`` body by re-slicing what the socket has not
    taken yet, a copy per send, so a 64 MiB body went at ~110 MB/s on loopback and in pieces at ~370 MB/s."""
    view = memoryview(data)
    for start in range(0, len(data), size):
        yield view[start:start + size]


class Buckets:
    """The buckets of one weight sync, each encoded once, on first demand, and let go once each of ``readers``
    replicas took it: the sender holds the buckets between its fastest and slowest replica, not a second copy
    of the whole model (14 GB for a 7B model in bf16). ``bound``: the size a stream declares up front."""

    def __init__(self, tensors: Mapping[str, Any], bucket_bytes: int, readers: int):
        from rlpipe.storage.weight_stream import bytes_bound, split_buckets

        if not tensors:
            raise ValueError("no tensors to send")
        self.tensors, self.names = tensors, split_buckets(tensors, bucket_bytes)
        self.bound = bytes_bound(tensors, self.names)
        self._made: dict[int, bytes] = {}
        self._left = [readers] * len(self.names)
        self._locks = [threading.Lock() for _ in self.names]

    def __len__(self) -> int:
        return len(self.names)

    def take(self, k: int) -> bytes:
        """Bucket ``k``'s safetensors bytes, for one reader."""
        from rlpipe.storage.weight_stream import encode_bucket

        with self._locks[k]:
            data = self._made.get(k) or encode_bucket(self.tensors, self.names[k])
            self._left[k] -= 1
            if self._left[k] > 0:
                self._made[k] = data
            else:
                self._made.pop(k, None)
        return data


def _read_folder(folder: str | Path) -> tuple[dict[str, Any], str]:
    """A folder's ``*.safetensors`` tensors and their sha256; FileNotFoundError where it holds none."""
    from rlpipe.storage.weights import load_safetensors_folder, weights_digest

    tensors = load_safetensors_folder(folder)
    if not tensors:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights")
    return tensors, weights_digest(tensors)


class RemoteEngine:
    """One rollout replica at ``url``."""

    def __init__(self, url: str, store: Any, run_id: str, timeout_s: float = 600.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.url, self.store, self.run_id, self.timeout_s = url.rstrip("/"), store, run_id, timeout_s
        self.bucket_bytes, self._client = bucket_bytes, None
        self.name = f"rollout@{self.url}"
        h = self.health()
        self._dtype, self._sha = str(h["dtype"]), str(h["version"])
        self.lora_rank = int(h.get("lora_rank") or 0)  # the LoRA rank it serves adapters up to (0: none)
        self.last_readback, self.last_sent = 0, 0

    def health(self) -> dict[str, Any]:
        return _health(self.url)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        try:
            r = http_client.post("rollout", f"{self.url}{path}", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise ReplicaDown(f"rollout replica {self.url}{path}: {type(e).__name__}: {e}") from None
        return self._answer(path, r)

    def _stream_call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """One request of a weight stream, on this engine's own connection: a new client per request (as
        ``http_client.post`` makes) loads the CA bundle into an SSL context, ~35 ms even for http://, and a
        stream makes 2 + buckets requests."""
        import httpx

        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_s)
        token = http_client.service_token("rollout")
        headers = kwargs.pop("headers", {}) | ({"Authorization": f"Bearer {token}"} if token else {})
        try:
            r = self._client.request(method, f"{self.url}{path}", headers=headers, **kwargs)
        except httpx.HTTPError as e:
            raise ReplicaDown(f"rollout replica {self.url}{path}: {type(e).__name__}: {e}") from None
        return self._answer(path, r)

    def _answer(self, path: str, r: Any) -> dict[str, Any]:
        """The JSON of an HTTP 200; ReplicaDown for a server error (5xx) or a full queue (429), ValueError when
        the replica refuses the request itself (another 4xx)."""
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
        """The folder's ``*.safetensors`` streamed to the replica (hashed once here)."""
        return self.load_tensors(*_read_folder(folder))

    def load_tensors(self, tensors: Mapping[str, Any], sha256: Digest) -> str:
        """``tensors`` (hashed by the caller: ``sha256``) streamed to the replica in buckets; the version it holds."""
        return self.send_buckets(Buckets(tensors, self.bucket_bytes, readers=1), resolved(sha256))

    def send_buckets(self, buckets: Buckets, sha256: str) -> str:
        """The buckets to the replica: begin, one PUT per bucket (the next one encoded meanwhile), commit; the
        version it then holds."""
        stream = self._stream_call("POST", "/weights/stream/begin", json={
            "sha256": sha256, "buckets": len(buckets), "bytes": buckets.bound})["stream"]
        with ThreadPoolExecutor(1) as ahead:
            nxt = ahead.submit(buckets.take, 0)
            for k in range(len(buckets)):
                data = nxt.result()
                if k + 1 < len(buckets):
                    nxt = ahead.submit(buckets.take, k + 1)
                self._stream_call("PUT", f"/weights/stream/{stream}/{k}", content=_pieces(data),
                                  headers={"Content-Length": str(len(data))})
        return self._loaded(self._stream_call("POST", f"/weights/stream/{stream}/commit"))

    def load_uri(self, uri: str, sha: str) -> str:
        """The weights already in the run's store under ``uri``, downloaded by the replica itself."""
        return self._loaded(self._post("/weights", {"uri": uri, "sha256": sha}))

    def load_adapter(self, folder: str | Path, version: str) -> str:
        """The LoRA adapter in ``folder`` (peft's layout) to the replica, which serves its base weights with it and
        reports ``version`` from now on; returns the sha256 of the adapter's tensors as the replica's engine read
        them."""
        return self.send_adapter(adapter_body(folder), version)

    def send_adapter(self, body: bytes, version: str) -> str:
        """An :func:`adapter_body` to the replica (``last_sent``: its bytes); the adapter's hash it reports."""
        got = self._stream_call("POST", "/adapter", params={"version": version}, content=body)
        self._sha, self.last_readback, self.last_sent = got["version"], 0, len(body)
        return got["adapter_sha256"]

    def _loaded(self, got: dict[str, Any]) -> str:
        self._sha, self.last_readback = got["version"], int(got.get("tensors", 0))
        return self._sha

    @property
    def dtype(self) -> str:
        return self._dtype

    def weights_sha256(self) -> str:
        return self._sha

    def close(self) -> None:  # the service outlives the run; only the stream's connection closes
        if self._client is not None:
            self._client.close()
            self._client = None


class ReplicatedEngine:
    """Several replicas as one engine: a request's prompts are split across the live ones; a replica
    that fails is left out from then on and its share is redone on the others."""

    def __init__(self, replicas: list[RemoteEngine], adapters: bool = False):
        """``adapters``: this run's syncs move only the LoRA adapter (its replicas serve LoRA)."""
        if not replicas:
            raise ValueError("no rollout replica: give at least one URL")
        self.replicas, self.dead, self.adapters = list(replicas), set(), adapters
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
        """``call``'s answer from every live replica (called in parallel), by URL in the replicas' order; one that
        is down is left out from then on."""
        live = self.live()
        with ThreadPoolExecutor(len(live)) as pool:
            futs = [(replica, pool.submit(call, replica)) for replica in live]
        out = {}
        for replica, fut in futs:
            try:
                out[replica.url] = fut.result()
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
        """The folder's ``*.safetensors`` streamed to every live replica (read and hashed once here)."""
        return self.load_tensors(*_read_folder(folder))

    def load_tensors(self, tensors: Mapping[str, Any], sha256: Digest) -> str:
        """``tensors`` encoded once and streamed to every live replica in parallel; the version they all hold."""
        sha256, live = resolved(sha256), self.live()
        buckets = Buckets(tensors, live[0].bucket_bytes, readers=len(live))
        return self._same(self._each(lambda replica: replica.send_buckets(buckets, sha256)))

    def load_uri(self, uri: str, sha: str) -> str:
        """Every live replica loads the weights under ``uri`` (checked against ``sha``); the version they hold."""
        return self._same(self._each(lambda replica: replica.load_uri(uri, sha)))

    def load_adapter(self, folder: str | Path, version: str) -> str:
        """The LoRA adapter in ``folder`` to every live replica in parallel (read once here); every one must read
        the same adapter and report ``version``. Returns the adapter's sha256 as they read it."""
        body = adapter_body(folder)
        held = self._each(lambda replica: (replica.send_adapter(body, version), replica.weights_sha256()))
        if not held:
            self.live()  # raises: every replica is down
        if len(set(held.values())) != 1:
            raise WeightSyncError(f"rollout replicas read different adapters or report different policies: {held}")
        return next(iter(held.values()))[0]

    @property
    def served_lora_rank(self) -> int:
        """The LoRA rank every live replica serves adapters up to: the smallest of theirs (0: one serves none).
        Not "0 unless they agree": replicas of ranks 8 and 16 both serve an adapter of rank 8, and a 0 here would
        turn a run's adapter syncs into merged ones without a word."""
        return min(replica.lora_rank for replica in self.live())

    @property
    def lora_rank(self) -> int | None:
        """The served LoRA rank while this run's syncs move only the adapter (``adapters``), else None: a replica's
        LoRA support alone does not make a run send adapters (the sync reads this as the engine's mode)."""
        return (self.served_lora_rank or None) if self.adapters else None

    def _same(self, held: dict[str, str]) -> str:
        """The one version every replica that answered holds after a reload."""
        if not held:
            self.live()  # raises: every replica is down
        if len(set(held.values())) != 1:
            raise WeightSyncError(f"rollout replicas hold different weights after the reload: {held}")
        return next(iter(held.values()))

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
        for replica in self.replicas:
            replica.close()

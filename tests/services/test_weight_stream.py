"""Weights streamed to rollout replicas over HTTP in safetensors buckets: the buckets join back to the same
tensors; two real replicas take a new policy without the object store and then compute what an in-process
engine holding it computes; a stream whose hash is wrong, with a bucket missing, too large or without the token
is refused with the reason, the replica keeps its weights, and the next good stream loads."""

from __future__ import annotations

import httpx
import pytest
import torch

from rlpipe.rollout.hf_engine import HFEngine
from rlpipe.rollout.probe import max_gap
from rlpipe.rollout.remote import Buckets, RemoteEngine, ReplicatedEngine
from rlpipe.storage.weight_stream import bytes_bound, decode_buckets, encode_buckets, split_buckets
from rlpipe.storage.weights import load_safetensors_folder, weights_digest
from tests.services.test_rollout_service import PROMPTS, _serve, perturbed, store  # noqa: F401 - fixture re-used

BUCKET = 16 << 10  # the tiny model's ~0.4 MB in a few dozen buckets


def test_buckets_join_back_to_the_same_tensors_in_name_order():
    g = torch.Generator().manual_seed(0)
    tensors = {"z.big": torch.randn(300, 20, generator=g),
               "a.bf16": torch.randn(40, 40, generator=g).to(torch.bfloat16),
               "m.small": torch.randn(7, generator=g), "m.empty": torch.zeros(0, 3),
               "b.int": torch.arange(10, dtype=torch.int64)}
    tensors["c.view"] = tensors["a.bf16"][:5]  # shares memory with a.bf16: sent as its own copy
    names = split_buckets(tensors, 3000)
    assert [n for b in names for n in b] == sorted(tensors)
    assert names == [["a.bf16"], ["b.int", "c.view", "m.empty", "m.small"], ["z.big"]]  # 3200 and 24 000 bytes: alone
    for b in names:
        assert len(b) == 1 or sum(tensors[n].numel() * tensors[n].element_size() for n in b) <= 3000
    buckets = encode_buckets(tensors, 3000)
    assert len(buckets) == 3 and all(isinstance(b, bytes) for b in buckets)
    back = decode_buckets(buckets)
    assert sorted(back) == sorted(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name
    assert weights_digest(back) == weights_digest(tensors)
    assert 0 <= bytes_bound(tensors, names) - sum(map(len, buckets)) <= 1000  # the size a stream declares first
    assert len(encode_buckets(tensors)) == 1  # the default bucket (64 MiB) takes them all
    with pytest.raises(ValueError, match="bucket 1 repeats tensors of an earlier bucket"):
        decode_buckets([buckets[0], buckets[0]])
    with pytest.raises(ValueError, match="bucket 0 is not safetensors bytes"):
        decode_buckets([b"not safetensors"])
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        split_buckets(tensors, 0)


def test_the_sender_encodes_each_bucket_once_and_lets_it_go_once_every_replica_took_it(tiny_checkpoint):
    tensors = load_safetensors_folder(tiny_checkpoint)
    want = encode_buckets(tensors, BUCKET)
    lazy = Buckets(tensors, BUCKET, readers=2)
    assert len(lazy) == len(want) and lazy.bound >= sum(map(len, want))
    assert lazy.take(0) == want[0] and lazy._made.keys() == {0}  # kept for the second replica
    assert lazy.take(1) == want[1] and lazy._made.keys() == {0, 1}
    assert lazy.take(0) == want[0] and lazy._made.keys() == {1}  # both took it: let go
    with pytest.raises(ValueError, match="no tensors to send"):
        Buckets({}, BUCKET, readers=1)


@pytest.fixture
def replicas(tiny_checkpoint, store):  # noqa: F811 - the store fixture
    servers = [_serve(HFEngine(tiny_checkpoint), tiny_checkpoint, store) for _ in range(2)]
    yield servers
    for server, _, _ in servers:
        server.should_exit = True


def test_two_replicas_take_streamed_weights_and_compute_what_the_sender_holds(replicas, tiny_checkpoint, store, tmp_path):  # noqa: F811
    new = perturbed(tiny_checkpoint, tmp_path / "new")
    tensors = load_safetensors_folder(new)
    sha = weights_digest(tensors)
    engine = ReplicatedEngine([RemoteEngine(url, store, "rl-stream", bucket_bytes=BUCKET) for _, _, url in replicas])
    assert engine.load_tensors(tensors, sha) == sha
    assert len(encode_buckets(tensors, BUCKET)) > 10  # it did go in many buckets
    local = HFEngine(tiny_checkpoint)
    local.load_tensors(tensors, sha)
    want = local.sequence_logprobs(PROMPTS, PROMPTS)
    for _, service, url in replicas:
        assert httpx.get(f"{url}/health").json()["version"] == sha and service.stats.weight_loads == 1
        assert max_gap(RemoteEngine(url, store, "rl-stream").sequence_logprobs(PROMPTS, PROMPTS), want) <= 1e-6
    assert max_gap(want, HFEngine(tiny_checkpoint).sequence_logprobs(PROMPTS, PROMPTS)) > 1e-3  # the weights moved
    assert store.list("runs") == []  # nothing went through the object store
    # load_weights(folder) streams as well: back to the start weights, on both replicas
    assert engine.load_weights(tiny_checkpoint) == HFEngine(tiny_checkpoint).weights_sha256()
    assert {httpx.get(f"{url}/health").json()["version"] for _, _, url in replicas} == {engine.weights_sha256()}
    assert store.list("runs") == []


def _begin(url: str, sha: str, parts: list[bytes], **kw) -> httpx.Response:
    body = {"sha256": sha, "buckets": len(parts), "bytes": sum(len(b) for b in parts)} | kw
    return httpx.post(f"{url}/weights/stream/begin", json=body)


def _stream(url: str, sha: str, buckets: list[bytes]) -> httpx.Response:
    stream = _begin(url, sha, buckets).json()["stream"]
    for k, b in enumerate(buckets):
        assert httpx.put(f"{url}/weights/stream/{stream}/{k}", content=b).status_code == 200
    return httpx.post(f"{url}/weights/stream/{stream}/commit")


def test_a_bad_stream_is_refused_the_replica_keeps_its_weights_and_the_next_stream_loads(replicas, tiny_checkpoint, tmp_path, store):  # noqa: F811
    _, service, url = replicas[0]
    before = httpx.get(f"{url}/health").json()["version"]
    lp_before = RemoteEngine(url, store, "rl-bad").sequence_logprobs(PROMPTS, PROMPTS)
    tensors = load_safetensors_folder(perturbed(tiny_checkpoint, tmp_path / "new"))
    sha = weights_digest(tensors)
    buckets = encode_buckets(tensors, BUCKET)
    other = encode_buckets({**tensors, "model.norm.weight": tensors["model.norm.weight"] + 1}, BUCKET)

    def refused(r: httpx.Response, code: int, words: str) -> None:
        assert r.status_code == code and words in r.text, r.text
        assert httpx.get(f"{url}/health").json()["version"] == before  # nothing was loaded

    refused(_stream(url, sha, other), 422, "the stream declared")  # a bucket not the sender's: the hash says so
    refused(_stream(url, before, buckets), 422, "the stream declared")  # the wrong hash declared
    with pytest.raises(ValueError, match="HTTP 422"):
        RemoteEngine(url, store, "rl-bad", bucket_bytes=BUCKET).load_tensors(tensors, before)
    refused(_begin(url, sha, buckets, bytes=service.max_stream_bytes + 1), 413, "at most")
    refused(_begin(url, "abc", buckets), 422, "sha256")
    refused(_begin(url, sha, buckets, buckets=0), 422, "buckets")
    stream = _begin(url, sha, buckets).json()["stream"]
    refused(httpx.put(f"{url}/weights/stream/{stream}/{len(buckets)}", content=buckets[0]), 422, "out of range")
    refused(httpx.put(f"{url}/weights/stream/nope/0", content=buckets[0]), 404, "is not open")
    refused(httpx.put(f"{url}/weights/stream/{stream}/0", content=buckets[0] + b"x" * sum(map(len, buckets))), 413, "exceed")
    for k, b in enumerate(buckets[:-1]):
        assert httpx.put(f"{url}/weights/stream/{stream}/{k}", content=b).status_code == 200
    refused(httpx.post(f"{url}/weights/stream/{stream}/commit"), 422, f"buckets [{len(buckets) - 1}] of {len(buckets)} are missing")
    past = buckets[0] + b"x" * (len(buckets[-1]) + 1)  # with the room of the missing bucket, one byte more
    refused(httpx.put(f"{url}/weights/stream/{stream}/0", content=past), 413, "exceed")
    refused(httpx.put(f"{url}/weights/stream/{stream}/{len(buckets) - 1}", content=b"x" * len(buckets[-1])), 422,
            f"bucket {len(buckets) - 1} is not safetensors bytes")
    refused(httpx.post(f"{url}/weights/stream/{stream}/commit"), 422, "are missing")  # the bad body was not kept
    stream = _begin(url, sha, other).json()["stream"]
    for k, b in enumerate(other):
        assert httpx.put(f"{url}/weights/stream/{stream}/{k}", content=b).status_code == 200
    refused(httpx.post(f"{url}/weights/stream/{stream}/commit"), 422, "the stream declared")
    refused(httpx.post(f"{url}/weights/stream/{stream}/commit"), 404, "is not open")  # a failed commit closed it
    first = _begin(url, sha, buckets).json()["stream"]
    _begin(url, sha, buckets)  # a second begin drops the first stream
    refused(httpx.put(f"{url}/weights/stream/{first}/0", content=buckets[0]), 404, "is not open")
    assert RemoteEngine(url, store, "rl-bad").sequence_logprobs(PROMPTS, PROMPTS) == lp_before
    r = _stream(url, sha, buckets)  # the service goes on: a good stream loads
    assert r.status_code == 200 and r.json()["version"] == sha == httpx.get(f"{url}/health").json()["version"]
    assert r.json()["tensors"] == len(tensors) and service.stats.weight_loads == 1


def test_the_stream_needs_the_token(tiny_checkpoint, store, monkeypatch, tmp_path):  # noqa: F811
    server, service, url = _serve(HFEngine(tiny_checkpoint), tiny_checkpoint, store, token="s3cret")
    try:
        tensors = load_safetensors_folder(perturbed(tiny_checkpoint, tmp_path / "new"))
        sha = weights_digest(tensors)
        buckets = encode_buckets(tensors, BUCKET)
        for r in (_begin(url, sha, buckets), httpx.put(f"{url}/weights/stream/x/0", content=buckets[0]),
                  httpx.post(f"{url}/weights/stream/x/commit")):
            assert r.status_code == 401 and "RLPIPE_ROLLOUT_TOKEN" in r.text, r.text
        monkeypatch.setenv("RLPIPE_ROLLOUT_TOKEN", "wrong")
        with pytest.raises(ValueError, match="HTTP 401"):
            RemoteEngine(url, store, "rl-tok", bucket_bytes=BUCKET).load_tensors(tensors, sha)
        monkeypatch.setenv("RLPIPE_ROLLOUT_TOKEN", "s3cret")  # every request of the stream carries it
        assert RemoteEngine(url, store, "rl-tok", bucket_bytes=BUCKET).load_tensors(tensors, sha) == sha
        assert service.stats.weight_loads == 1 and service.stats.unauthorized == 4
    finally:
        server.should_exit = True

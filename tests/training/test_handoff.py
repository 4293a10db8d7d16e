"""The weights handed to an engine in memory: the tensors and hash the trainer hands over are the ones its save
point writes (two hub architectures, the tiny model, LoRA's merged weights), hashed once per update, and an
engine fed them runs the trainer's policy (vLLM and HF) without touching the trainer's tensors."""

import pytest
import torch

from rlpipe.config import TrainConfig
from rlpipe.storage.weights import file_weights_digest, load_safetensors_folder
from rlpipe.training.trainer import PolicyTrainer
from tests.helpers.dist_update import fixed_batch

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
PROMPTS, CONTS = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15]]


def _trainer(folder, **train):
    cfg = TrainConfig(**({"algorithm": "grpo", "batch_size": 16, "micro_batch_size": 8, "lr": 1e-2} | train))
    return PolicyTrainer(model_dir=str(folder), cfg=cfg, seed=3, max_new_tokens=5)


def _model(name, standins, tiny_checkpoint):
    return tiny_checkpoint if name == "tiny" else standins[name]


@pytest.mark.parametrize("name,lora", [("qwen2", False), ("llama", False), ("tiny", False), ("qwen2", True)])
def test_handed_tensors_are_what_the_save_point_writes(name, lora, standins, tiny_checkpoint, tmp_path):
    torch.set_num_threads(1)
    t = _trainer(_model(name, standins, tiny_checkpoint), **({"lora": LORA} if lora else {}))
    t.update(fixed_batch(16), 0)
    digest, tensors = t.policy_tensors()
    assert t.policy_tensors()[0] is digest  # hashed once per update
    assert t.export_weights(tmp_path / "w") == digest == file_weights_digest(tmp_path / "w")
    saved = load_safetensors_folder(tmp_path / "w")
    assert sorted(saved) == sorted(tensors)  # the names save_pretrained keeps (tied copies dropped)
    assert all(torch.equal(saved[k], tensors[k].cpu()) for k in saved)
    if not lora:  # the module's own tensors: no copy of the model per sync
        own = {p.data_ptr() for p in t.module.parameters()}
        assert all(v.data_ptr() in own for v in tensors.values() if v.dtype.is_floating_point)
    t.update(fixed_batch(32)[16:], 1)
    assert t.policy_tensors()[0] != digest  # an update drops the hash: the next one is of the new weights


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_an_engine_fed_in_memory_runs_the_trainers_policy(kind, arch, standins):
    from rlpipe.rollout.engines import new_engine

    torch.set_num_threads(1)
    t = _trainer(standins[arch])
    t.update(fixed_batch(16), 0)
    digest, tensors = t.policy_tensors()
    before = {k: v.clone() for k, v in tensors.items()}
    engine = new_engine(kind, standins[arch], max_model_len=64)
    try:
        start = engine.sequence_logprobs(PROMPTS, CONTS)
        assert engine.load_tensors(tensors, digest) == digest == engine.weights_sha256()
        trained = t.sequence_logprobs(PROMPTS, CONTS)
        got = engine.sequence_logprobs(PROMPTS, CONTS)
        gap = max(abs(x - y) for a, b in zip(got, trained) for x, y in zip(a, b))
        moved = max(abs(x - y) for a, b in zip(start, trained) for x, y in zip(a, b))
        assert gap < 5e-2 < moved or gap < moved / 20  # 16-bit engines round; the policy moved far more than that
        assert all(torch.equal(before[k], tensors[k]) for k in tensors)  # the engine copied, never wrote, them
    finally:
        engine.close()


def test_the_hash_runs_on_a_thread_and_the_next_update_waits_for_it(standins, monkeypatch):
    """``handoff`` gives the tensors at once and their hash as a future, computed on a thread; an engine fed the
    future reports the hash once it is done; an update begun while the hash still reads the weights waits for it,
    so the hash is of the weights handed over, never of weights changed under it."""
    import threading

    from rlpipe.rollout.engines import new_engine
    from rlpipe.storage import weights
    from rlpipe.training import saving

    torch.set_num_threads(1)
    t = _trainer(standins["qwen2"])
    t.update(fixed_batch(16), 0)
    gate, real = threading.Event(), weights.weights_digest
    monkeypatch.setattr(saving, "weights_digest", lambda ts: (gate.wait(60), real(ts))[1])
    pending, tensors = t.handoff()
    assert not pending.done()  # the caller goes on while the hash runs
    expected = real({k: v.clone() for k, v in tensors.items()})
    engine = new_engine("hf", standins["qwen2"], max_model_len=64)
    try:
        held = engine.load_tensors(tensors, pending)
        assert held is pending and not pending.done()  # the engine holds the tensors; their hash is not waited for
        threading.Timer(0.5, gate.set).start()
        assert engine.weights_sha256() == expected  # asked for, it is
    finally:
        engine.close()
    gate.clear()
    t._handoff = None  # hashed anew, as after an update; the hash now waits at the gate
    pending, tensors = t.handoff()
    expected = real({k: v.clone() for k, v in tensors.items()})
    threading.Timer(0.5, gate.set).start()
    t.update(fixed_batch(32)[16:], 1)  # waits for the hash before the optimizer changes the weights in place
    assert pending.result() == expected
    assert t.policy_tensors()[0] != expected  # and the update's own weights hash anew


def test_the_engine_is_proven_while_the_hash_is_still_taken(standins, monkeypatch):
    """The sync in memory: the probe runs once the engine holds the tensors, before their hash is done; the sync
    ends with the hash the engine reports, and a hash other than the update's still fails it after the probe."""
    import threading

    from rlpipe.guards import WeightSyncError
    from rlpipe.rollout.engines import new_engine
    from rlpipe.rollout.probe import ProbeBatch, SyncProof, load_policy
    from rlpipe.storage import weights
    from rlpipe.training import saving

    torch.set_num_threads(1)
    t = _trainer(standins["qwen2"])
    t.update(fixed_batch(16), 0)
    gate, real = threading.Event(), weights.weights_digest
    monkeypatch.setattr(saving, "weights_digest", lambda ts: (gate.wait(60), real(ts))[1])
    proof, seen = SyncProof(ProbeBatch(PROMPTS, CONTS), tolerance=0.1), {}
    engine = new_engine("hf", standins["qwen2"], max_model_len=64)

    def meanwhile():
        seen["hash_done"] = t.handoff()[0].done()
        seen["proof"] = proof.prove(engine, t, "iteration 0")
        gate.set()

    try:
        held = load_policy(engine, None, None, 0, trainer=t, meanwhile=meanwhile)
        expected = real({k: v.clone() for k, v in t.handoff()[1].items()})
        assert seen["hash_done"] is False and seen["proof"]["probe_max_abs_diff"] <= 0.1
        assert held == expected == engine.weights_sha256()
        with pytest.raises(WeightSyncError, match="its weights changed after the update"):
            load_policy(engine, None, "ff" * 32, 0, trainer=t, meanwhile=lambda: seen.update(again=True))
        assert seen["again"]
    finally:
        engine.close()


def test_the_trainers_side_of_the_probe_runs_ahead_on_a_thread(standins):
    """``SyncProof.trainer_ahead``: the trainer's probe log-probs computed on a thread while the engine reloads,
    equal to the ones computed in line; a trainer service gets none (it streams the weights meanwhile)."""
    from rlpipe.rollout.probe import ProbeBatch, SyncProof

    torch.set_num_threads(1)
    t = _trainer(standins["qwen2"])
    t.update(fixed_batch(16), 0)
    proof = SyncProof(ProbeBatch(PROMPTS, CONTS), tolerance=1e-3)
    ahead = proof.trainer_ahead(t)
    assert ahead is not None and ahead.result() == t.sequence_logprobs(PROMPTS, CONTS)
    saved = []  # the probe's forward builds no autograd graph: nothing is kept for a backward that never comes
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        t.sequence_logprobs(PROMPTS, CONTS)
    assert saved == []

    class Service:  # what SyncProof reads of a trainer service: it is remote
        remote, world = True, 1

    assert proof.trainer_ahead(Service()) is None

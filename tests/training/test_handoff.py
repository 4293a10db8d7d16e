"""The weights handed to an engine in memory: the tensors and hash the trainer hands over are the ones its save
point writes (two hub architectures, the tiny model, LoRA's merged weights), hashed once per update, and an
engine fed them runs the trainer's policy (vLLM and HF) without touching the trainer's tensors."""

import pytest
import torch

from rlpipe.config import TrainConfig
from rlpipe.storage.weights import file_weights_sha256, load_safetensors_folder
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
    assert t.export_weights(tmp_path / "w") == digest == file_weights_sha256(tmp_path / "w")
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

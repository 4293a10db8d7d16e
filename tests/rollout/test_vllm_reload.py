"""The direct reload into vLLM's CPU model (rlpipe.rollout.vllm_reload) against vLLM's own reload, on both hub
stand-ins (Qwen2: tied, fused qkv with biases, bf16, padded vocabulary; Llama: untied, fp16, a list EOS) and the
toy: the same tensors give bitwise the same log-probs either way; the engine keeps its own copy (the trainer's
tensors changed afterwards change nothing); a tensor the model has no place for, one missing or of another
shape leaves the direct path to vLLM's, which still refuses what it cannot consume; a model that vLLM's failed
reload left half on meta is restored by vLLM's own reload, not the direct one (a copy into meta does nothing)."""

import pytest
import torch

from rlpipe.rollout import vllm_engine
from rlpipe.rollout.base import WeightSyncError
from rlpipe.rollout.engines import new_engine
from rlpipe.rollout.vllm_reload import plan_direct_reload
from rlpipe.storage.weights import load_safetensors_folder, weights_digest

PROMPTS = [[3, 5, 7, 11, 13], [17, 19, 23]]
CONTS = [[29, 31, 37, 41], [43, 47]]


def _moved(tensors: dict, seed: int) -> dict:
    """float32 tensors a little away from ``tensors`` (as a trainer hands them after an update)."""
    g = torch.Generator().manual_seed(seed)
    return {n: t.float() + 0.02 * torch.randn(t.shape, generator=g) for n, t in tensors.items()}


def _load(engine, tensors: dict) -> list[list[float]]:
    engine.load_tensors(tensors, weights_digest(tensors))
    return engine.sequence_logprobs(PROMPTS, CONTS)


@pytest.fixture(params=["qwen2", "llama", "toy"])
def engine_and_tensors(request, standins, tiny_checkpoint):
    folder = tiny_checkpoint if request.param == "toy" else standins[request.param]
    engine = new_engine("vllm", folder, max_model_len=64, seed=0)
    try:
        yield engine, load_safetensors_folder(folder)
    finally:
        engine.close()


def test_the_direct_reload_gives_vllms_policy_and_owns_its_weights(engine_and_tensors, monkeypatch):
    engine, start = engine_and_tensors
    moved = _moved(start, 1)
    direct = _load(engine, moved)
    assert engine.last_reload == "direct" and engine.last_readback >= 1
    assert direct != _load(engine, _moved(start, 2))  # the policy moved with the weights
    with monkeypatch.context() as m:
        m.setattr(vllm_engine, "direct_reload", lambda model, tensors: None)
        assert _load(engine, moved) == direct and engine.last_reload == "vllm"  # bitwise, token by token
    assert _load(engine, moved) == direct and engine.last_reload == "direct"
    for t in moved.values():  # the trainer's next step, in place: the engine serves what it was handed
        t.mul_(1.5)
    assert engine.sequence_logprobs(PROMPTS, CONTS) == direct


def test_names_or_shapes_the_model_does_not_have_leave_it_to_vllm(standins):
    engine = new_engine("vllm", standins["qwen2"], max_model_len=64, seed=0)
    try:
        start = {n: t.float() for n, t in load_safetensors_folder(standins["qwen2"]).items()}

        def plans(tensors):
            return engine.llm.apply_model(lambda model: plan_direct_reload(model, tensors) is not None)[0]

        qkv = next(n for n in start if n.endswith("k_proj.weight"))
        norm = next(n for n in start if n.endswith("input_layernorm.weight"))
        assert plans(start)
        assert not plans(start | {"model.extra.weight": torch.zeros(4, 4)})  # left over
        assert not plans({n: t for n, t in start.items() if n != qkv})  # a part of a fused layer missing
        assert not plans({n: t for n, t in start.items() if n != norm})  # a plain parameter missing
        assert not plans(start | {qkv: start[qkv][:-1]})  # a part of the wrong shape
        assert not plans(start | {norm: torch.ones(start[norm].shape[0] - 1)})  # only a vocabulary is padded
        before = engine.sequence_logprobs(PROMPTS, CONTS)
        with pytest.raises((WeightSyncError, ValueError), match="did not consume|no module or parameter named"):
            engine.load_tensors(start | {"model.extra.weight": torch.zeros(4, 4)}, "x" * 64)
        assert engine.last_reload == "vllm"
        assert not plans(start)  # vLLM's failed reload left layers on meta: vLLM's own reload restores them
        assert _load(engine, start) == before and engine.last_reload == "vllm"
        assert _load(engine, start) == before and engine.last_reload == "direct"
    finally:
        engine.close()

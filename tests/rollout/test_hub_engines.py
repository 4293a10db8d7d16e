"""Both engines on hub-style checkpoints: the two failures a first real checkpoint met, and the sync proof.

Regressions: vLLM refused every sync of a checkpoint whose vocabulary it pads (716 -> 768 rows: "after reload
vLLM holds different values for ['model.embed_tokens.weight']", and lm_head too when untied); the HF engine
failed on an EOS given as an int ("'int' object is not iterable")."""

import json

import pytest
import torch

from rlpipe.rollout.base import SamplingConfig
from rlpipe.rollout.engines import new_engine
from rlpipe.rollout.probe import default_tolerance
from rlpipe.tokens import encode_prompt
from rlpipe.storage.weights import file_weights_digest
from rlpipe.training.checkpoint import load_checkpoint

PROMPT = json.dumps([{"role": "user", "content": "小明有3个苹果，又买了5个。一共多少个？"}])


def _trainer_logprobs(folder, prompt, cont):
    model, _, _ = load_checkpoint(folder)  # float32, as the trainer holds the policy
    with torch.no_grad():
        lp = model(torch.tensor([prompt + cont])).logits[0, :-1].float().log_softmax(-1)
    return [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(cont)]


@pytest.mark.parametrize("kind", ["hf", "vllm"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_generate_sync_and_probe_on_hub_checkpoints(standins, kind, arch):
    folder = standins[arch]
    engine = new_engine(kind, folder, max_model_len=256, seed=0)
    try:
        tok = load_checkpoint(folder)[1]
        prompt = encode_prompt(tok, PROMPT, chat=True)
        outs = engine.generate([prompt], SamplingConfig(n=3, max_new_tokens=12, seed=0))[0]
        assert len(outs) == 3 and all(1 <= len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids) for c in outs)
        assert all((c.finish_reason == "stop") == (c.token_ids[-1] in engine.stop_ids) for c in outs)
        # The sync: the checkpoint's own 16-bit tensors fed back in, read back, hashed as fed.
        assert engine.load_weights(folder) == file_weights_digest(folder)
        assert engine.last_readback >= 1
        cont = outs[0].token_ids
        gap = max(abs(a - b) for a, b in zip(engine.sequence_logprobs([prompt], [cont])[0],
                                             _trainer_logprobs(folder, prompt, cont)))
        assert gap < default_tolerance(engine.dtype)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_both_engines_stop_on_each_token_of_a_list_eos(standins, kind):
    """Llama's EOS is a list: a response ends at whichever comes first, in both engines alike."""
    folder = standins["llama"]
    engine = new_engine(kind, folder, max_model_len=128, seed=0, stop_tokens=None)
    try:
        gen = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
        assert set(gen) <= set(engine.stop_ids)
    finally:
        engine.close()
    # An explicit stop token every sample must meet: the most likely first token of the greedy response.
    probe = new_engine(kind, folder, max_model_len=128, seed=0)
    tok = load_checkpoint(folder)[1]
    prompt = encode_prompt(tok, PROMPT, chat=True)
    first = probe.generate([prompt], SamplingConfig(n=1, temperature=0.0, max_new_tokens=1))[0][0].token_ids[0]
    probe.close()
    engine = new_engine(kind, folder, max_model_len=128, seed=0, stop_tokens=[first])
    try:
        out = engine.generate([prompt], SamplingConfig(n=1, temperature=0.0, max_new_tokens=8))[0][0]
        assert out.token_ids == [first] and out.finish_reason == "stop"
    finally:
        engine.close()


def test_readback_leaves_tensor_parallel_shards_to_the_probe():
    from rlpipe.rollout.vllm_engine import _sharded

    assert _sharded(torch.Size([358, 64]), torch.Size([716, 64]), 2)
    assert _sharded(torch.Size([64, 128]), torch.Size([64, 256]), 2)
    assert not _sharded(torch.Size([716, 64]), torch.Size([716, 64]), 2)  # unsharded: compared
    assert not _sharded(torch.Size([300, 64]), torch.Size([716, 64]), 2)  # not a shard: a difference


@pytest.mark.parametrize("arch,tool_role", [("qwen2", "<|im_start|>tool"), ("llama", "<|start_header_id|>ipython")])
def test_agent_turns_use_the_checkpoints_template_with_its_tool_role(standins, arch, tool_role):
    """An observation is framed as the template frames a tool message: the ids an episode builds turn by turn
    are the ids of the whole conversation rendered at once."""
    from rlpipe.envs import EnvLimits, EnvSpec
    from rlpipe.rollout.multiturn import TurnFormat, run_episodes

    tok = load_checkpoint(standins[arch])[1]
    fmt = TurnFormat.of(tok, chat=True)
    msgs = [{"role": "user", "content": "12*34?"}, {"role": "assistant", "content": "calc 12*34"},
            {"role": "tool", "content": "=408"}]
    whole = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    first = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    stop = tok.convert_tokens_to_ids(fmt.close[: fmt.close.index(">") + 1]) if fmt.close.startswith("<|") else None
    assert stop in load_checkpoint(standins[arch])[1].all_special_ids and tool_role in whole
    built = first + "calc 12*34" + tok.convert_ids_to_tokens(stop) + fmt.observation_text("=408", tok.convert_ids_to_tokens(stop))
    assert built == whole
    engine = new_engine("hf", standins[arch], seed=0)
    spec = EnvSpec(env="calculator", params={"digits": 2}, limits=EnvLimits(max_steps=2))
    out = run_episodes(engine, tok, spec, [({}, s) for s in range(3)],
                       SamplingConfig(temperature=1.0, max_new_tokens=6, seed=0), chat=True, max_context=256)
    for r in out:
        assert r.episode.status == "ok" and len(r.response_ids) == len(r.logprobs) == len(r.loss_mask)
        assert tok.decode(r.prompt_ids).startswith("<|im_start|>" if arch == "qwen2" else "<|begin_of_text|><|start")


def test_no_hidden_context_cap_a_response_of_thousands_of_tokens(standins):
    """The engine's context is what the prompts and max_new_tokens need, up to the model's own (8,192 here), not
    a constant: a 2,048-token response comes back whole (rollout.stop_tokens: [] -- no end token)."""
    from rlpipe.config import RunConfig
    from rlpipe.runtime.assembly import context_length

    cfg = RunConfig.model_validate({"rollout": {"max_new_tokens": 2048}})
    rows = [{"prompt": PROMPT}]
    length = context_length(cfg, rows, str(standins["qwen2"]))
    assert 2048 < length <= 8192
    with pytest.raises(ValueError, match="exceeds the model's own context"):
        context_length(RunConfig.model_validate({"rollout": {"max_model_len": 9000}}), rows, str(standins["qwen2"]))
    tok = load_checkpoint(standins["qwen2"])[1]
    engine = new_engine("vllm", standins["qwen2"], max_model_len=length, seed=0, stop_tokens=[])
    try:
        out = engine.generate([encode_prompt(tok, PROMPT, chat=True)], SamplingConfig(n=1, max_new_tokens=2048, seed=0))
        assert len(out[0][0].token_ids) == 2048 and out[0][0].finish_reason == "length"
    finally:
        engine.close()

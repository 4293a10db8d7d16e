"""`rlpipe plan`: exact parameter counts, the memory arithmetic by hand, advice when it does not fit."""

import json

import pytest
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from rlpipe.cli import app
from rlpipe.config import RunConfig
from rlpipe.training.plan import count_parameters_meta, plan_memory


def _cfg(**train):
    return RunConfig.model_validate({"train": {"batch_size": 8, "micro_batch_size": 8, **train},
                                     "rollout": {"batch_size": 2, "samples_per_prompt": 4, "max_new_tokens": 16}})


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_parameters_counted_exactly_without_loading(standins, arch):
    model = AutoModelForCausalLM.from_pretrained(standins[arch])
    real = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # tied embeddings once
    assert count_parameters_meta(standins[arch]) == (real, real)


def test_components_by_hand(standins):
    folder = standins["qwen2"]  # hidden 256, 6 layers, 4 heads, 2 kv heads (head_dim 64), vocabulary 716, bf16
    p, _ = count_parameters_meta(folder)
    plan = plan_memory(_cfg(kl_coef=0.05, precision="bf16"), folder, gpu=True, prompt_tokens=48)
    c = plan.components
    assert c["policy_weights"] == 4 * p and c["gradients"] == 4 * p and c["optimizer_moments"] == 8 * p
    assert c["reference"] == 2 * p  # bf16: the checkpoint's own dtype
    assert c["engine_weights"] == 2 * p
    assert c["engine_kv_cache"] == 2 * 6 * 2 * 64 * 2 * (2 * 4) * (48 + 16)
    s, b, h, a = 64, 8, 256, 4  # Korthikanti et al.: s·b·h·(34 + 5as/h) bytes a layer in 16 bits, + logits
    layers = 6 * s * b * h * (34 + 5 * a * s / h)
    assert c["activations"] == int(layers + 3 * 4 * b * 16 * 716)  # logits at the 16 response positions of each
    chunked = plan_memory(_cfg(kl_coef=0.05, precision="bf16", logits_chunk=32), folder, gpu=True, prompt_tokens=48)
    assert chunked.components["activations"] == int(layers + 3 * 4 * 32 * 716)  # one chunk's
    assert plan.tokens_per_iteration == 8 * 64 and "critic" not in c


def test_zero_splits_and_lora_shrinks(standins):
    folder = standins["qwen2"]
    p, _ = count_parameters_meta(folder)
    z2 = plan_memory(_cfg(zero_stage=2), folder, gpu=False, world=4).components
    assert z2["gradients"] == 4 * p // 4 and z2["optimizer_moments"] == 8 * p // 4
    assert z2["policy_weights"] == 4 * p  # whole on every rank until ZeRO-3
    z3 = plan_memory(_cfg(zero_stage=3), folder, gpu=True, world=4).components
    assert z3["policy_weights"] == 4 * p // 4 and z3["gradients"] == 4 * p // 4
    off = plan_memory(_cfg(zero_stage=2, offload_optimizer=True), folder, gpu=True, world=4, budget=2**40)
    assert "optimizer_moments" not in off.components
    assert off.components["cpu_optimizer_offload"] == 8 * p // 4 + 4 * p // 4  # moments + fp32 partition
    assert off.total_bytes == sum(v for k, v in off.components.items() if k != "cpu_optimizer_offload")
    lora = plan_memory(_cfg(lora={"r": 4}, kl_coef=0.05), folder, gpu=False)
    from rlpipe.config import LoraConfig
    from rlpipe.training.lora import with_lora

    peft_model = with_lora(AutoModelForCausalLM.from_pretrained(folder), LoraConfig(r=4))
    assert lora.trainable == sum(q.numel() for q in peft_model.parameters() if q.requires_grad) < p / 10
    assert "reference" not in lora.components  # the base with adapters off
    # the stand-in is bf16: LoRA keeps its frozen base in 16 bits, the adapters in float32
    assert lora.components["policy_weights"] == 2 * (p - lora.trainable) + 4 * lora.trainable
    ppo = plan_memory(_cfg(algorithm="ppo"), folder, gpu=False).components
    assert ppo["critic"] == 16 * p


def test_bf16_weights_counts_bfloat16_weights_beside_float32_masters(standins):
    folder = standins["qwen2"]
    p, _ = count_parameters_meta(folder)
    one = plan_memory(_cfg(precision="bf16_weights", zero_stage=1, kl_coef=0.05, algorithm="ppo"), folder, gpu=True)
    c = one.components
    assert c["policy_weights"] == 2 * p and c["master_weights"] == 4 * p and c["gradients"] == 4 * p
    assert c["bf16_gradients"] == 2 * p  # each micro-batch's, beside the float32 accumulation
    assert c["optimizer_moments"] == 8 * p and c["reference"] == 2 * p and c["critic"] == 18 * p
    autocast = plan_memory(_cfg(precision="bf16", zero_stage=1, kl_coef=0.05, algorithm="ppo"), folder, gpu=True)
    assert c["activations"] == autocast.components["activations"]  # 16-bit activations either way
    four = plan_memory(_cfg(precision="bf16_weights", zero_stage=2, offload_optimizer=True), folder, gpu=True, world=4)
    assert four.components["policy_weights"] == 2 * p and four.components["gradients"] == 4 * p // 4
    assert "master_weights" not in four.components  # offloaded with the moments
    assert four.components["cpu_optimizer_offload"] == 8 * p // 4 + 4 * p // 4


def test_cli_says_what_to_change_when_it_does_not_fit(standins):
    res = CliRunner().invoke(app, ["plan", "--set", f"task.policy_model={standins['qwen2']}", "--gpu-mem", "0.05"])
    assert res.exit_code == 1 and "fits in 0.05 GiB: no" in res.stdout
    assert "train.lora" in res.stdout and "train.gradient_checkpointing: true" in res.stdout
    ok = CliRunner().invoke(app, ["plan", "--set", f"task.policy_model={standins['qwen2']}", "--gpu-mem", "80", "--json"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["fits"] is True


def test_a_token_budget_sizes_the_activations(standins):
    """8 sequences of 64 tokens, or a budget of 130 tokens: two sequences a micro-batch."""
    folder = standins["qwen2"]
    whole = plan_memory(_cfg(), folder, gpu=False, prompt_tokens=48).components["activations"]
    two = plan_memory(_cfg(max_tokens_per_micro_batch=130), folder, gpu=False, prompt_tokens=48).components["activations"]
    assert two == pytest.approx(whole / 4, rel=1e-6)


def test_logits_past_a_gib_are_advised_into_chunks(standins):
    """64 responses of 2,048 tokens at a vocabulary of 716: 3 × 4 × 131,072 × 716 bytes of logits (1.05 GiB); the
    advice names train.logits_chunk, and with it the plan counts one chunk's."""
    folder = standins["qwen2"]
    cfg = {"train": {"batch_size": 64, "micro_batch_size": 64}, "rollout": {"batch_size": 8, "samples_per_prompt": 8,
                                                                             "max_new_tokens": 2048}}
    plan = plan_memory(RunConfig.model_validate(cfg), folder, gpu=True, budget=2**30)
    assert plan.fits is False and plan.logit_rows == 64 * 2048
    assert any(a.startswith("train.logits_chunk: 1024") and "1.0 GiB → 0.01 GiB" in a for a in plan.advice)
    cfg["train"]["logits_chunk"] = 1024
    chunked = plan_memory(RunConfig.model_validate(cfg), folder, gpu=True, budget=2**30)
    saved = plan.components["activations"] - chunked.components["activations"]
    assert saved == 3 * 4 * (64 * 2048 - 1024) * 716 and not any("logits_chunk" in a for a in chunked.advice)

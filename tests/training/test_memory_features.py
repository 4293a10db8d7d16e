"""Memory features on hub-style stand-ins: gradient checkpointing, the reference in the checkpoint's dtype, LoRA
(the reference is the base with adapters off, the sync is the merged weights and the probe still holds, a resume
lands on identical adapters)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlpipe.config import TrainConfig
from rlpipe.training.trainer import PolicyTrainer
from tests.helpers.dist_update import fixed_batch


def _trainer(folder, resume=None, **train):
    cfg = TrainConfig(**({"algorithm": "grpo", "batch_size": 16, "micro_batch_size": 8, "lr": 1e-3} | train))
    return PolicyTrainer(model_dir=str(folder), cfg=cfg, seed=3, resume_dir=resume and str(resume), max_new_tokens=5)


def test_gradient_checkpointing_gives_the_same_update(standins):
    torch.set_num_threads(1)
    plain, ckpt = _trainer(standins["qwen2"]), _trainer(standins["qwen2"], gradient_checkpointing=True)
    assert ckpt.module.is_gradient_checkpointing and not plain.module.is_gradient_checkpointing
    a, b = plain.update(fixed_batch(16), 0), ckpt.update(fixed_batch(16), 0)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for (name, p), (_, q) in zip(plain.module.named_parameters(), ckpt.module.named_parameters()):
        assert torch.allclose(p, q, atol=1e-6), name


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_reference_kept_in_the_checkpoints_dtype_under_bf16(standins, precision, dtype):
    t = _trainer(standins["qwen2"], precision=precision, kl_coef=0.05)
    assert t.ref.dtype == dtype and next(t.module.parameters()).dtype == torch.float32  # fp32 master weights


def _sampled_by(trainer, batch):
    """The batch with the log-probs the trainer's policy now gives its tokens (as if it had sampled them)."""
    from dataclasses import replace

    lps = trainer.sequence_logprobs([b.prompt_ids for b in batch], [b.response_ids for b in batch])
    return [replace(b, old_logprobs=lp) for b, lp in zip(batch, lps)]


LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_lora_trains_adapters_only_with_the_base_as_reference(standins, arch, tmp_path):
    torch.set_num_threads(1)
    t = _trainer(standins[arch], lora=LORA, kl_coef=0.05)
    assert t.ref is None and t.ref_is_base  # no second copy of the weights
    trainable = {n for n, p in t.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    base_before = {n: p.detach().clone() for n, p in t.module.named_parameters() if not p.requires_grad}
    m = t.update(_sampled_by(t, fixed_batch(16)), 0)
    assert m["kl"] == pytest.approx(0.0, abs=1e-5)  # B starts at zero: the policy is its reference
    m2 = t.update(_sampled_by(t, fixed_batch(32)[16:]), 1)
    assert m2["kl"] > 1e-7  # the adapters moved it away (one step at lr 1e-3: ~2e-5)
    for n, p in t.module.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), n

    digest = t.export_weights(tmp_path / "sync")
    saved = load_file(tmp_path / "sync" / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in saved)  # a plain HF checkpoint of the merged weights
    assert ("lm_head.weight" in saved) == (arch == "llama")  # tied embeddings stay tied
    from rlpipe.rollout.hf_engine import HFEngine

    from rlpipe.rollout.engines import new_engine

    prompts, conts = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15]]
    trained = t.sequence_logprobs(prompts, conts)
    t.save(tmp_path / "state")
    adapter_sha = json.loads((tmp_path / "state" / "trainer_state.json").read_text())["adapter_sha256"]

    def gap(engine):
        return max(abs(x - y) for a, b in zip(engine.sequence_logprobs(prompts, conts), trained) for x, y in zip(a, b))

    for kind, tol in (("hf", 1e-4), ("vllm", 1e-3)):  # vLLM: the probe's float32 tolerance
        engine = HFEngine(standins[arch]) if kind == "hf" else new_engine("vllm", standins[arch], max_model_len=64)
        try:
            assert engine.load_weights(tmp_path / "sync") == digest
            assert gap(engine) < tol, kind
        finally:
            engine.close()
    # rollout.lora_sync adapter: vLLM keeps the start model and takes only the adapter (its LoRA support)
    engine = new_engine("vllm", standins[arch], max_model_len=64, lora_rank=LORA["r"])
    try:
        assert gap(engine) > 1e-6  # the base alone is not the trained policy …
        assert engine.load_adapter(tmp_path / "state" / "adapter", version=digest) == adapter_sha
        assert engine.weights_sha256() == digest and gap(engine) < 1e-3  # … the base with the adapter is
    finally:
        engine.close()


def test_lora_resume_lands_on_identical_adapters(standins, tmp_path):
    torch.set_num_threads(1)
    a = _trainer(standins["llama"], lora=LORA)
    a.update(fixed_batch(16), 0)
    a.save(tmp_path / "state")
    assert json.loads((tmp_path / "state" / "adapter" / "adapter_config.json").read_text())["r"] == 4
    a.update(fixed_batch(32)[16:], 1)
    b = _trainer(standins["llama"], resume=tmp_path / "state", lora=LORA)
    b.update(fixed_batch(32)[16:], 1)
    for (name, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q), name


def test_lora_target_that_matches_nothing_is_refused(standins):
    with pytest.raises(ValueError, match=r"\['qkv'\] match no linear module .* named \[.*'q_proj'"):
        _trainer(standins["qwen2"], lora=LORA | {"target_modules": ["q_proj", "qkv"]})


def test_export_merged_equals_peft_merge_and_the_adapter_names_its_base(standins, tmp_path):
    """`rlpipe export --merge` of a LoRA save point: a plain HF folder whose weights equal peft's own
    merge_and_unload of base + adapter; without --merge, the adapter, loadable onto its base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from rlpipe.cli import app

    torch.set_num_threads(1)
    t = _trainer(standins["qwen2"], lora=LORA)
    t.update(fixed_batch(16), 0)
    t.save(tmp_path / "state")
    runner = CliRunner()
    assert runner.invoke(app, ["export", str(tmp_path / "state"), str(tmp_path / "merged"), "--merge"]).exit_code == 0
    assert runner.invoke(app, ["export", str(tmp_path / "state"), str(tmp_path / "adapter")]).exit_code == 0
    assert {p.name for p in (tmp_path / "merged").iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert not (tmp_path / "merged" / "deepspeed").exists() and not (tmp_path / "merged" / "trainer_state.json").exists()
    adapter_cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(standins["qwen2"])
    base = AutoModelForCausalLM.from_pretrained(standins["qwen2"], dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    assert reference.keys() == merged.keys()
    for k in reference:
        assert torch.allclose(reference[k], merged[k], atol=1e-6), k
    assert runner.invoke(app, ["export", str(tmp_path / "state"), str(tmp_path / "merged")]).exit_code == 2  # not empty


@pytest.mark.parametrize("arch", ["llama"])  # untied embeddings; tied ones: the 2-rank test on the tiny model
def test_zero3_exports_whole_weights_and_resumes_to_the_same_update(standins, arch, tmp_path):
    """ZeRO-3 holds each weight partitioned; its export gathers them into the folder ZeRO-0 writes, and a resume
    from its save point lands on the uninterrupted run's next update."""
    torch.set_num_threads(1)
    plain, z3 = _trainer(standins[arch]), _trainer(standins[arch], zero_stage=3)
    assert z3.engine.zero_optimization_partition_weights()
    assert all(p.numel() == 0 for n, p in z3.module.named_parameters() if "proj" in n)  # partitioned away
    plain.update(fixed_batch(16), 0)
    z3.update(fixed_batch(16), 0)
    plain.export_weights(tmp_path / "zero0")
    z3.save(tmp_path / "zero3")
    a, b = load_file(tmp_path / "zero0" / "model.safetensors"), load_file(tmp_path / "zero3" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.allclose(a[k], b[k], atol=1e-5), k  # 1% of an lr-1e-3 step
    z3.update(fixed_batch(32)[16:], 1)
    after = z3.export_weights(tmp_path / "after")
    resumed = _trainer(standins[arch], resume=tmp_path / "zero3", zero_stage=3)
    resumed.update(fixed_batch(32)[16:], 1)
    assert resumed.export_weights(tmp_path / "resumed") == after


def test_optimizer_offload_runs_the_step_on_cpu_with_the_same_result(standins):
    torch.set_num_threads(1)
    z2, off = _trainer(standins["qwen2"], zero_stage=2), _trainer(standins["qwen2"], zero_stage=2, offload_optimizer=True)
    assert off.engine.zero_cpu_offload() and not z2.engine.zero_cpu_offload()
    a, b = z2.update(fixed_batch(16), 0), off.update(fixed_batch(16), 0)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    for (name, p), (_, q) in zip(z2.module.named_parameters(), off.module.named_parameters()):
        assert torch.allclose(p, q, atol=1e-6), name
    state = next(iter(off.engine.optimizer.optimizer.state.values()))
    assert state["exp_avg"].device.type == "cpu"


def test_zero3_with_lora_and_offload_without_zero_are_refused():
    with pytest.raises(ValueError, match="ZeRO stage 3 with train.lora is refused.*zero_stage 2"):
        TrainConfig(zero_stage=3, lora={"r": 4})
    with pytest.raises(ValueError, match="offload_optimizer needs ZeRO"):
        TrainConfig(offload_optimizer=True)


@pytest.mark.parametrize("arch,dtype", [("qwen2", torch.bfloat16), ("llama", torch.float16)])
def test_lora_under_bf16_keeps_the_base_in_16_bits_and_the_probe_in_float32(standins, arch, dtype, tmp_path):
    """LoRA with precision bf16: the frozen base in the checkpoint's 16-bit dtype (no float32 master: nothing
    optimizes it), adapters float32. The export is the float32 merge (base + B·A·α/r unrounded), and the trainer's
    probe log-probs are the float32 forward of exactly those weights."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.dist_update import fixed_batch as batch

    torch.set_num_threads(1)
    t = _trainer(standins[arch], lora=LORA, precision="bf16")
    frozen = [p for p in t.module.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == dtype for p in frozen)
    assert all(p.dtype == torch.float32 for p in t.module.parameters() if p.requires_grad)
    t.update(batch(16), 0)
    t.export_weights(tmp_path / "merged")
    assert all(p.dtype == dtype for p in frozen)  # the probe's float32 view is undone
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert next(merged.parameters()).dtype == torch.float32
    prompts, conts = [[5, 9, 13, 21], [7, 3]], [[4, 8, 15], [16, 23, 42, 8]]
    mine = t.sequence_logprobs(prompts, conts)
    with torch.no_grad():
        for p, c, lp in zip(prompts, conts, mine):
            logits = merged(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
            ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(c)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(lp), ref, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2"])  # bf16; the fp16 Llama base: the test above
def test_lora_over_a_16_bit_checkpoint_keeps_it_16_bit_with_the_float32_update(standins, arch, monkeypatch):
    """precision fp32, a bf16/fp16 checkpoint: the frozen base stays 16-bit (half the memory) and every layer
    computes in float32 from it, so the update is the one a float32 copy of the base gives, up to the summation
    order of matrix products."""
    torch.set_num_threads(1)
    half = _trainer(standins[arch], lora=LORA, kl_coef=0.05, gradient_checkpointing=True)
    assert {p.dtype for p in half.module.parameters() if not p.requires_grad and p.dim() == 2} == {
        torch.bfloat16 if arch == "qwen2" else torch.float16}
    monkeypatch.setattr(PolicyTrainer, "_base_dtype", lambda self, src: torch.float32)
    full = _trainer(standins[arch], lora=LORA, kl_coef=0.05, gradient_checkpointing=True)
    assert all(p.dtype == torch.float32 for p in full.module.parameters())
    # The adapters' random init draws differently after a 16-bit load: start both from the same adapters.
    full.module.load_state_dict({k: v for k, v in half.module.state_dict().items() if ".lora_" in k}, strict=False)
    for batch, k in ((fixed_batch(16), 0), (fixed_batch(32)[16:], 1)):
        a, b = half.update(batch, k), full.update(batch, k)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for (name, p), (_, q) in zip(half.module.named_parameters(), full.module.named_parameters()):
        if p.requires_grad:
            assert torch.allclose(p, q, atol=1e-5), name  # 1% of an lr-1e-3 step
    prompts, conts = [[5, 9, 13], [7, 3, 2, 11]], [[4, 8], [16, 23, 42]]
    moved = max(abs(x - y) for p, q in zip(full.sequence_logprobs(prompts, conts), _trainer(standins[arch]).sequence_logprobs(
        prompts, conts)) for x, y in zip(p, q))
    gap = max(abs(x - y) for p, q in zip(half.sequence_logprobs(prompts, conts), full.sequence_logprobs(prompts, conts))
              for x, y in zip(p, q))
    assert gap < 1e-6 and moved > 1e-4


def test_token_budget_micro_batches_on_a_hub_checkpoint(standins):
    """train.max_tokens_per_micro_batch on the Qwen2 stand-in (BPE ids, bf16 on disk), packed: more, smaller
    micro-batches than by count, and the same update."""
    torch.set_num_threads(1)
    count, budget = _trainer(standins["qwen2"], kl_coef=0.05), _trainer(standins["qwen2"], kl_coef=0.05,
                                                                         max_tokens_per_micro_batch=24)
    a, b = count.update(fixed_batch(16), 0), budget.update(fixed_batch(16), 0)
    assert b["micro_batches"] > a["micro_batches"] and b["micro/over_budget"] == 0
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["kl"] == pytest.approx(a["kl"], rel=1e-5, abs=1e-9)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    # The policies, not the weights: Adam turns the rounding of near-zero gradients (vocabulary rows no sampled
    # token touches) into whole ±lr steps either way.
    prompts, conts = [[5, 9, 13, 21], [7, 3]], [[4, 8, 15], [16, 23, 42, 8]]
    pa, pb = count.sequence_logprobs(prompts, conts), budget.sequence_logprobs(prompts, conts)
    assert max(abs(x - y) for u, v in zip(pa, pb) for x, y in zip(u, v)) < 1e-4

"""train.precision bf16_weights: the weights held in bfloat16 (no cast per op), float32 master weights, gradient
accumulation and Adam moments in DeepSpeed's bf16 optimizer; the engine handed the bfloat16 weights and proven on
them; a save point keeps the masters, so a resume continues from them. On both hub stand-ins (BPE tokenizers, chat
templates, 16-bit checkpoints)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlpipe.config import TrainConfig
from rlpipe.storage.samples import Sample
from rlpipe.training.trainer import PolicyTrainer
from tests.helpers.dist_update import fixed_batch

PROMPTS, CONTS = [[5, 6, 7, 8], [9, 10], [11, 40, 41]], [[11, 12, 13], [14, 15], [60, 61, 62, 63]]


def _trainer(folder, resume=None, **train):
    cfg = TrainConfig(**({"algorithm": "grpo", "batch_size": 16, "micro_batch_size": 8, "lr": 1e-3,
                          "precision": "bf16_weights", "zero_stage": 1} | train))
    return PolicyTrainer(model_dir=str(folder), cfg=cfg, seed=3, resume_dir=resume and str(resume), max_new_tokens=5)


def _masters(trainer) -> torch.Tensor:
    """The optimizer's float32 master weights, flat (DeepSpeed's bf16 optimizer and ZeRO 1/2 both keep them so)."""
    groups = trainer.engine.optimizer.state_dict()["single_partition_of_fp32_groups"]
    return torch.cat([g.detach().reshape(-1) for g in groups])


def _flat(trainer) -> torch.Tensor:
    """The module's bfloat16 weights, flat in the masters' order (DeepSpeed flattens the groups it steps)."""
    opt = trainer.engine.optimizer
    flat = torch.cat([g.detach().reshape(-1) for g in getattr(opt, "bf16_groups_flat", None) or opt.bit16_groups_flat])
    return flat[: _masters(trainer).numel()]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_weights_are_bfloat16_and_the_optimizer_steps_float32_masters(standins, arch):
    """At lr 1e-5 a step is below a bfloat16 weight's resolution (2^-8 relative): the masters move, most bfloat16
    weights do not, and each is its master rounded. Without float32 masters nothing would move at all."""
    torch.set_num_threads(1)
    t = _trainer(standins[arch], lr=1e-5, kl_coef=0.05)
    assert {p.dtype for p in t.module.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in t.ref.parameters()} == {torch.bfloat16}
    start = _masters(t).clone()
    assert start.dtype == torch.float32 and torch.equal(start, _flat(t).float())  # the start weights, rounded once
    before = _flat(t).clone()
    m = t.update(fixed_batch(16), 0)
    assert m["optimizer_steps"] == 1 and m["nonfinite_steps"] == 0 and m["grad_norm"] > 0
    masters, weights = _masters(t), _flat(t)
    moved = (masters != start).float().mean()
    assert moved > 0.9  # Adam's first step moves every weight with a gradient by ~lr
    assert float((masters - start).abs().max()) == pytest.approx(1e-5, rel=0.05)
    assert (weights != before).float().mean() < 0.5 * moved  # most bf16 weights cannot show a 1e-5 step
    assert torch.equal(weights, masters.to(torch.bfloat16))
    moments = [v for s in t.engine.optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    assert moments and all(v.dtype == torch.float32 for v in moments)


class _WeightCasts(TorchDispatchMode):
    """Counts dtype conversions whose input is one of ``params`` (by storage)."""

    def __init__(self, params):
        super().__init__()
        self.weights, self.count = {p.data_ptr() for p in params}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and args[0].data_ptr() in self.weights:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision,casts", [("bf16", True), ("bf16_weights", False)])
def test_no_weight_is_cast_per_op_under_bf16_weights(standins, precision, casts):
    """Under autocast each layer casts its float32 weight to bfloat16 in every forward (and again for the backward);
    with the weights in bfloat16 no weight is converted in a micro-batch's forward and backward. (What is converted
    there: each gradient, once, into its float32 accumulator: the masters' gradient accumulation.)"""
    torch.set_num_threads(1)
    t = _trainer(standins["qwen2"], precision=precision, zero_stage=1, kl_coef=0.0)
    from rlpipe.training.packing import collate

    micro = collate(fixed_batch(8), {}, t.tokenizer.pad_token_id, pack=True, share=True).to(t.device)
    with _WeightCasts(t.module.parameters()) as seen:
        lp, _ = t._forward(micro, t.engine)
        lp.sum().backward()
    layers = sum(1 for n, _ in t.module.named_parameters() if n.endswith("proj.weight"))
    assert (seen.count >= layers if casts else seen.count == 0), seen.count


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_engine_takes_the_bfloat16_weights_and_the_probe_holds(standins, arch):
    """The handed tensors are the trainer's bfloat16 weights; a float32 engine (HF and vLLM, in memory) holds them
    exactly, and its forward matches the trainer's probe forward (float32 of the same weights) to float32's
    tolerance, not bfloat16's."""
    from rlpipe.rollout.engines import new_engine
    from rlpipe.rollout.hf_engine import HFEngine

    torch.set_num_threads(1)
    t = _trainer(standins[arch])
    t.update(fixed_batch(16), 0)
    digest, tensors = t.policy_tensors()
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}
    trained = t.sequence_logprobs(PROMPTS, CONTS)
    for kind, tol in (("hf", 1e-4), ("vllm", 1e-3)):  # the probe's float32 tolerances
        engine = HFEngine(standins[arch]) if kind == "hf" else new_engine("vllm", standins[arch], max_model_len=64)
        try:
            before = max(abs(x - y) for a, b in zip(engine.sequence_logprobs(PROMPTS, CONTS), trained) for x, y in zip(a, b))
            assert engine.load_tensors(tensors, digest) == digest
            gap = max(abs(x - y) for a, b in zip(engine.sequence_logprobs(PROMPTS, CONTS), trained) for x, y in zip(a, b))
            assert gap < tol < before, (kind, gap, before)
        finally:
            engine.close()


@pytest.mark.parametrize("zero", [1, 2])
def test_a_resume_continues_from_the_float32_masters(standins, zero, tmp_path):
    """The save point's HF weights are bfloat16; its optimizer state holds the float32 masters, and a resume takes
    them (not the rounded weights): the same masters, the same next update as the uninterrupted run."""
    torch.set_num_threads(1)
    t = _trainer(standins["qwen2"], zero_stage=zero, lr=1e-4)
    t.update(fixed_batch(16), 0)
    t.save(tmp_path / "state")
    saved = _masters(t).clone()
    assert not torch.equal(saved, _flat(t).float())  # the masters hold what bfloat16 rounds away
    t.update(fixed_batch(32)[16:], 1)
    after, after_masters = t.export_weights(tmp_path / "after"), _masters(t).clone()
    resumed = _trainer(standins["qwen2"], resume=tmp_path / "state", zero_stage=zero, lr=1e-4)
    assert torch.equal(_masters(resumed), saved)
    resumed.update(fixed_batch(32)[16:], 1)
    assert torch.equal(_masters(resumed), after_masters)
    assert resumed.export_weights(tmp_path / "resumed") == after


@pytest.mark.parametrize("zero", [1, 2])
def test_a_non_finite_step_leaves_weights_and_masters_untouched(standins, zero):
    t = _trainer(standins["llama"], batch_size=8, micro_batch_size=4, zero_stage=zero)
    good = fixed_batch(8)
    weights, masters = _flat(t).clone(), _masters(t).clone()
    nan = [Sample(s.prompt_ids, s.response_ids, [float("nan")] * len(s.response_ids), s.reward, s.group) for s in good]
    m = t.update(nan, 0)
    assert m["nonfinite_steps"] == 1 and m["optimizer_steps"] == 0
    assert torch.equal(_flat(t), weights) and torch.equal(_masters(t), masters)
    assert t.update(good, 1)["optimizer_steps"] == 1 and not torch.equal(_masters(t), masters)


def test_the_probe_leaves_the_weights_where_the_optimizer_steps_them(standins):
    """The probe's float32 forward swaps each bfloat16 weight for a float32 copy and back: back means the same
    storage, a view into the optimizer's flat buffer, so the next step still moves the module's weights."""
    t = _trainer(standins["qwen2"])
    t.update(fixed_batch(16), 0)
    t.sequence_logprobs(PROMPTS, CONTS)
    t.update(fixed_batch(32)[16:], 1)
    module = torch.cat([p.detach().reshape(-1) for p in t.engine.optimizer.bf16_groups[0]])
    assert torch.equal(module, _flat(t)[: module.numel()])
    assert torch.equal(module, _masters(t)[: module.numel()].to(torch.bfloat16))


@pytest.mark.parametrize("arch,zero", [("qwen2", 1), ("llama", 2)])
def test_updates_raise_the_rewarded_responses_with_a_probe_between(standins, arch, zero):
    """Four on-policy GRPO updates on one scored batch, each after a probe (as each iteration's sync runs one):
    the rewarded responses' log-probability rises against the unrewarded ones'."""
    from dataclasses import replace

    torch.set_num_threads(1)
    t = _trainer(standins[arch], lr=3e-4, zero_stage=zero)
    batch = [s for s in fixed_batch(16) if s.reward is not None]

    def logprobs():
        return t.sequence_logprobs([s.prompt_ids for s in batch], [s.response_ids for s in batch])

    def margin(lps):
        mean = lambda r: sum(sum(lp) for lp, s in zip(lps, batch) if s.reward == r) / sum(s.reward == r for s in batch)  # noqa: E731
        return mean(1.0) - mean(0.0)

    start = margin(logprobs())
    for k in range(4):
        lps = logprobs()
        t.update([replace(s, old_logprobs=lp) for s, lp in zip(batch, lps)], k)
    assert margin(logprobs()) > start + 2.0, (start, margin(logprobs()))  # -0.1 → 10.8 here; 0 change unlinked


def test_an_idle_micro_batch_adds_no_gradient(standins):
    """A rank with nothing in a micro-batch slot still runs a backward (the step's collectives need it). DeepSpeed's
    bf16 optimizer clears the previous micro-batch's bfloat16 gradients in a hook on the engine's output and adds
    them into float32 after every backward: an idle backward that bypassed the engine's forward counted them twice."""
    from rlpipe.training.packing import collate

    t = _trainer(standins["qwen2"], batch_size=16, micro_batch_size=8, kl_coef=0.0)
    opt = t.engine.optimizer
    micro = collate(fixed_batch(8), {}, t.tokenizer.pad_token_id, pack=True, share=True).to(t.device)
    lp, _ = t._forward(micro, t.engine)
    t.engine.backward(lp.sum())
    once = torch.cat([g.reshape(-1) for g in opt.fp32_groups_gradients_flat]).clone()
    assert float(once.norm()) > 0
    t.engine.backward(t._idle_loss(t.engine))
    assert torch.equal(torch.cat([g.reshape(-1) for g in opt.fp32_groups_gradients_flat]), once)


def test_optimizer_offload_keeps_the_masters_on_cpu_with_the_same_result(standins):
    torch.set_num_threads(1)
    z2, off = _trainer(standins["qwen2"], zero_stage=2), _trainer(standins["qwen2"], zero_stage=2, offload_optimizer=True)
    assert off.engine.zero_cpu_offload()
    a, b = z2.update(fixed_batch(16), 0), off.update(fixed_batch(16), 0)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert torch.equal(_masters(z2), _masters(off)) and torch.equal(_flat(z2), _flat(off))


@pytest.mark.parametrize("extra", [{"gradient_checkpointing": True}, {"logits_chunk": 8}], ids=["checkpointing", "chunks"])
def test_checkpointing_and_chunked_logits_give_the_same_update(standins, extra):
    """Recomputed activations are the same bfloat16 ops (the same update, to the bit); the output layer in chunks
    rounds its products in other shapes (the same loss and gradient norm to bfloat16's precision)."""
    torch.set_num_threads(1)
    plain, other = _trainer(standins["qwen2"], kl_coef=0.05), _trainer(standins["qwen2"], kl_coef=0.05, **extra)
    a, b = plain.update(fixed_batch(16), 0), other.update(fixed_batch(16), 0)
    if "gradient_checkpointing" in extra:
        assert a["loss"] == b["loss"] and torch.equal(_masters(plain), _masters(other))
        return
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-2, abs=1e-3)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-2)
    assert float((_masters(plain) - _masters(other)).abs().max()) <= 2.5e-3  # at most ~one Adam step of lr 1e-3 apart


def test_ppo_critic_and_reference_hold_bfloat16_too(standins):
    torch.set_num_threads(1)
    t = _trainer(standins["qwen2"], algorithm="ppo", kl_coef=0.05, critic={"lr": 1e-4})
    assert {p.dtype for p in t.critic.module.parameters()} == {torch.bfloat16}
    m = t.update(fixed_batch(16), 0)
    assert m["optimizer_steps"] == 1 and m["nonfinite_steps"] == 0
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())


def test_bf16_weights_without_zero_with_zero3_or_with_lora_is_refused():
    with pytest.raises(ValueError, match="bf16_weights needs DeepSpeed's bf16 optimizer.*zero_stage: 1"):
        TrainConfig(precision="bf16_weights")
    with pytest.raises(ValueError, match="bf16_weights needs.*precision: bf16 with train.lora"):
        TrainConfig(precision="bf16_weights", zero_stage=2, lora={"r": 4})
    with pytest.raises(ValueError, match="bf16_weights with ZeRO stage 3 is refused.*zero_stage 1 or 2"):
        TrainConfig(precision="bf16_weights", zero_stage=3)

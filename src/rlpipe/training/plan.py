"""``rlpipe plan``: the memory a run's config needs, component by component, before anything is loaded.

Parameters are counted exactly (the architecture built on the meta device, no weights read); everything else is
arithmetic on the config. Per trainer rank, bytes:

- policy weights: float32 master copy, 4·P (``precision: bf16`` is autocast over float32 weights); LoRA over a
  16-bit checkpoint or under bf16 keeps the frozen base in 16 bits, 2·(P − P_train) + 4·P_train; ZeRO-3 splits
  them by rank; ``bf16_weights``: 2·P, and the optimizer's float32 masters 4·P/N (``master_weights``);
- gradients: 4·P_train (P_train = P, or the adapters' parameters under LoRA); ZeRO ≥ 2 splits them by rank;
  ``bf16_weights`` adds the micro-batch's bfloat16 gradients, 2·P_train (``bf16_gradients``, measured at ZeRO 1);
- Adam moments: 8·P_train; ZeRO ≥ 1 splits them by rank; ``offload_optimizer`` moves them and the fp32
  partition (4·P_train/N) to CPU memory (``cpu_optimizer_offload``, not in the GPU's total);
- reference: P in float32, or in the checkpoint's dtype under bf16, in bfloat16 under bf16_weights; none under LoRA (adapters off) or without KL;
- critic (PPO): weights, gradients and moments of a second trunk, 16·P (18·P under bf16_weights: 16-bit weights
  beside float32 masters);
- activations of one micro-batch (B sequences of S tokens; under ``max_tokens_per_micro_batch`` B = budget // S, hidden h, L layers, vocabulary V): Korthikanti et
  al. 2022 (arXiv:2205.05198, eq. 2) give s·b·h·(34 + 5·a·s/h) bytes a layer in 16 bits; float32 doubles it.
  With gradient checkpointing a layer keeps only its input (4·s·b·h) and one layer is recomputed at a time. The
  logits and their log-softmax and gradient: 3·4·n·V for the n = B·R positions that predict a response token (R:
  ``rollout.max_new_tokens``; a prompt's positions get none), or n = ``train.logits_chunk`` where that is smaller;
- runtime: a fixed 0.1 GiB (``RUNTIME_BYTES``: DeepSpeed's engine object, the allocator, peft), measured on CPU;
- the engine: its weights (float32 on CPU, the checkpoint's dtype on a GPU) and the KV cache of one rollout
  batch: 2·L·kv_heads·head_dim·bytes per token, for every completion's prompt and response.

The figures are checked against measured peaks in ``benchmarks/plan_memory.py`` (benchmarks/README.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MemoryPlan", "plan_memory", "count_parameters_meta"]

GiB = 2**30
# What a trainer process holds beside the tensors the plan counts (DeepSpeed's engine, the allocator's slack,
# peft's wrappers, the tokenizer): 0.08-0.14 GiB measured on CPU as the gap between the peak and the counted
# tensors in the LoRA rows of benchmarks/plan_memory.py, where every counted tensor is alive at the peak.
RUNTIME_BYTES = int(0.1 * GiB)


@dataclass
class MemoryPlan:
    """Bytes per component (trainer rank and engine), the tokens of an iteration, and advice when it does not fit."""

    parameters: int
    trainable: int
    components: dict[str, int] = field(default_factory=dict)
    tokens_per_iteration: int = 0
    budget: int | None = None
    advice: list[str] = field(default_factory=list)
    vocab: int = 0  # the output layer's columns
    logit_rows: int = 0  # the positions whose logits exist at once (in the activations)

    @property
    def trainer_bytes(self) -> int:
        return sum(v for k, v in self.components.items() if not k.startswith(("engine", "cpu_")))

    @property
    def total_bytes(self) -> int:
        return sum(v for k, v in self.components.items() if not k.startswith("cpu_"))

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.total_bytes <= self.budget

    def to_dict(self) -> dict[str, Any]:
        return {"parameters": self.parameters, "trainable": self.trainable, "components": self.components,
                "trainer_bytes": self.trainer_bytes, "total_bytes": self.total_bytes,
                "tokens_per_iteration": self.tokens_per_iteration, "budget": self.budget, "fits": self.fits,
                "advice": self.advice}


def _shape(model_cfg: dict[str, Any]) -> dict[str, int]:
    h = int(model_cfg["hidden_size"])
    heads = int(model_cfg["num_attention_heads"])
    return {"h": h, "L": int(model_cfg["num_hidden_layers"]), "heads": heads,
            "kv": int(model_cfg.get("num_key_value_heads") or heads),
            "head_dim": int(model_cfg.get("head_dim") or h // heads), "V": int(model_cfg["vocab_size"])}


def count_parameters_meta(folder: str | Path, lora: Any = None) -> tuple[int, int]:
    """(parameters, trainable parameters) of the checkpoint's architecture, built on the meta device; trainable
    are the LoRA adapters' under ``lora`` (a ``LoraConfig`` of rlpipe's config), else all of them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if lora is None:
        return total, total
    from rlpipe.training.lora import with_lora

    peft_model = with_lora(model, lora)
    return total, sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def _activations(s: dict[str, int], batch: int, seq: int, checkpointing: bool, act_bytes: int, logit_rows: int) -> int:
    per_layer = seq * batch * s["h"] * (34 + 5 * s["heads"] * seq / s["h"]) * act_bytes / 2
    layers = (s["L"] * 2 * seq * batch * s["h"] * act_bytes + per_layer) if checkpointing else s["L"] * per_layer
    logits = 3 * 4 * logit_rows * s["V"]
    return int(layers + logits)


def plan_memory(cfg: Any, folder: str | Path, gpu: bool, budget: int | None = None, world: int = 1,
                prompt_tokens: int = 64) -> MemoryPlan:
    """The plan for run config ``cfg`` (a ``RunConfig``) on the checkpoint in ``folder``; ``prompt_tokens``: the
    longest prompt in tokens."""
    t, r = cfg.train, cfg.rollout
    model_cfg = json.loads((Path(folder) / "config.json").read_text())
    s = _shape(model_cfg.get("text_config", model_cfg))
    ckpt_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(model_cfg.get("dtype") or model_cfg.get("torch_dtype"), 4)
    total, trainable = count_parameters_meta(folder, t.lora)
    seq = prompt_tokens + r.max_new_tokens
    z = t.zero_stage
    # LoRA over a 16-bit checkpoint, or under bf16: the frozen base in 16 bits (no master copy: nothing optimizes
    # it), the adapters in float32.
    half_base = t.lora and (ckpt_bytes == 2 or t.precision == "bf16")
    bf16w = t.precision == "bf16_weights"  # bfloat16 weights; the float32 masters are the optimizer's (ZeRO >= 1)
    weights = 2 * (total - trainable) + 4 * trainable if half_base else (2 if bf16w else 4) * total
    comp = {"policy_weights": weights // (world if z >= 3 else 1),
            "gradients": 4 * trainable // (world if z >= 2 else 1),
            "optimizer_moments": 8 * trainable // (world if z >= 1 else 1)}
    if bf16w:  # the masters; and a micro-batch's bfloat16 gradients, alive beside their float32 accumulation
        comp["master_weights"] = 4 * trainable // world
        comp["bf16_gradients"] = 2 * trainable
    if t.offload_optimizer and gpu:  # in CPU memory: not the GPU's
        masters = comp.pop("master_weights") if bf16w else (4 * trainable // world if z >= 1 else 0)
        comp["cpu_optimizer_offload"] = comp.pop("optimizer_moments") + masters
    if t.uses_reference and not t.lora:
        comp["reference"] = total * {"bf16": ckpt_bytes, "bf16_weights": 2}.get(t.precision, 4)
    if (t.advantage or "") == "gae" or t.algorithm == "ppo":
        comp["critic"] = (18 if bf16w else 16) * total
    act_bytes = 4 if t.precision == "fp32" else 2
    rows = t.micro_batch_size
    if t.max_tokens_per_micro_batch:  # a token budget: as many sequences of the longest length as fit (at least one)
        rows = max(1, t.max_tokens_per_micro_batch // seq)
    logit_rows = min(rows * r.max_new_tokens, t.logits_chunk or rows * r.max_new_tokens)
    comp["activations"] = _activations(s, rows, seq, t.gradient_checkpointing, act_bytes, logit_rows)
    engine_bytes = ckpt_bytes if gpu else 4
    comp["runtime"] = RUNTIME_BYTES
    comp["engine_weights"] = total * engine_bytes
    completions = r.batch_size * r.samples_per_prompt
    comp["engine_kv_cache"] = 2 * s["L"] * s["kv"] * s["head_dim"] * engine_bytes * completions * seq
    plan = MemoryPlan(total, trainable, comp, completions * seq, budget, vocab=s["V"], logit_rows=logit_rows)
    if plan.fits is False:
        plan.advice = _advice(plan, cfg)
    return plan


def _advice(plan: MemoryPlan, cfg: Any) -> list[str]:
    """What to change, largest saving first."""
    c, t, out = plan.components, cfg.train, []
    if not t.lora:
        out.append(f"train.lora: {{r: 16}} trains adapters only: gradients and Adam moments "
                   f"{(c['gradients'] + c['optimizer_moments']) / GiB:.1f} GiB → a few MB, and no reference copy")
    if t.zero_stage < 2 and not t.lora:
        out.append("train.zero_stage: 2 with N ranks (rlpipe run --nproc N) splits gradients and moments N ways")
    if t.zero_stage < 3 and not t.lora and t.precision != "bf16_weights":  # stage 3 refuses bf16_weights
        out.append("train.zero_stage: 3 with N ranks splits the weights too (each rank gathers a layer as it runs)")
    if t.zero_stage >= 1 and not t.offload_optimizer:
        out.append(f"train.offload_optimizer: true moves the Adam moments ({c['optimizer_moments'] / GiB:.1f} GiB) "
                   "to CPU memory (the step runs there)")
    if not t.gradient_checkpointing:
        out.append(f"train.gradient_checkpointing: true: activations {c['activations'] / GiB:.2f} GiB → about 1/L of them")
    logits = 3 * 4 * plan.logit_rows * plan.vocab  # as the activations count them
    if not t.logits_chunk and logits > GiB:
        out.append(f"train.logits_chunk: 1024 keeps the logits of 1,024 positions at a time: {logits / GiB:.1f} GiB → "
                   f"{3 * 4 * min(1024, plan.logit_rows) * plan.vocab / GiB:.2f} GiB (the backward recomputes them)")
    if t.micro_batch_size > 1:
        out.append(f"train.micro_batch_size: {max(t.micro_batch_size // 2, 1)} halves the activations (batch_size stays; "
                   "more accumulation steps)")
    if cfg.rollout.gpu_memory_utilization > 0.2:
        out.append("rollout.gpu_memory_utilization lower, or the rollout on its own GPU (services.rollout)")
    return out


def format_plan(plan: MemoryPlan) -> str:
    lines = [f"parameters {plan.parameters / 1e6:.2f}M, trainable {plan.trainable / 1e6:.2f}M; "
             f"{plan.tokens_per_iteration:,} tokens per iteration at most"]
    for k, v in plan.components.items():
        lines.append(f"  {k:<18} {v / GiB:8.3f} GiB")
    lines.append(f"  {'trainer (rank)':<18} {plan.trainer_bytes / GiB:8.3f} GiB")
    lines.append(f"  {'total':<18} {plan.total_bytes / GiB:8.3f} GiB")
    if plan.budget is not None:
        lines.append(f"fits in {plan.budget / GiB:.2f} GiB: {'yes' if plan.fits else 'no'}")
        lines += [f"  - {a}" for a in plan.advice]
    return "\n".join(lines)

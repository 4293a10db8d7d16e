"""LoRA adapters on the policy, and the 16-bit base under them.

:func:`with_lora` puts peft adapters on a model (or a save point's adapters back on it), :func:`lora_targets` checks
``target_modules`` against the model's linear layers, and :func:`merged_state_dict` gives the weights the adapted
model computes with, under the base model's names (what the engine is synced with). A frozen base is kept in 16
bits; :func:`upcast_frozen` and :func:`float_weights` let it compute in float32 where the run asks for that.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = ["float_weights", "lora_targets", "merged_state_dict", "upcast_frozen", "with_lora"]

def with_lora(model: Any, cfg: Any, adapter_dir: Path | None = None) -> Any:
    """``model`` with peft LoRA adapters per ``train.lora``; the adapter weights of ``adapter_dir`` when resuming.
    A target that matches no module is refused with the model's linear layer names."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_dir is not None:
        if not (adapter_dir / "adapter_config.json").exists():
            raise FileNotFoundError(f"{adapter_dir} holds no LoRA adapter (adapter_config.json); was the save point "
                                    "written by a run without train.lora?")
        return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    peft_cfg = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=lora_targets(model, cfg.target_modules),
                          bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, peft_cfg)


def lora_targets(model: Any, targets: str | list[str], exclude: str | None = None, key: str = "train.lora") -> str | list[str]:
    """``targets`` checked against the model's linear layers (a name that matches none is refused, with the
    names there are). ``exclude``: a module kept out of 'all-linear' (a scalar head trained in full): the
    linear layers' leaf names but its own."""
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if targets == "all-linear":
        if exclude is None:
            return targets
        return sorted({n.rsplit(".", 1)[-1] for n in names if not (n == exclude or n.startswith(exclude + "."))})
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ValueError(f"{key}.target_modules: {missing} match no linear module of the model; its linear "
                         f"layers are named {leaves} (or use 'all-linear')")
    return targets


class _UpcastLinear(torch.autograd.Function):
    """``F.linear`` with a frozen 16-bit weight computed in the input's float32: the backward upcasts the weight
    again instead of keeping a float32 copy of it alive between forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None


def upcast_frozen(model: Any) -> None:
    """Each frozen 16-bit layer of ``model`` computes in float32 (train.precision fp32 over a 16-bit LoRA base):
    linear layers through :class:`_UpcastLinear`, embeddings by upcasting what they look up; the small 16-bit
    parameters left (norms) are made float32."""
    for module in model.modules():
        low = [p for p in module.parameters(recurse=False) if p.dtype in (torch.bfloat16, torch.float16)]
        if not low or any(p.requires_grad for p in low):
            continue
        if isinstance(module, torch.nn.Linear):
            module.forward = lambda x, m=module: _UpcastLinear.apply(x, m.weight, m.bias)
        elif isinstance(module, torch.nn.Embedding):
            plain = module.forward
            module.forward = lambda ids, f=plain: f(ids).float()
        else:
            module.float()


@contextmanager
def float_weights(model: Any):
    """The model's 16-bit parameters (a LoRA base kept in 16 bits; every weight under bf16_weights) in float32
    while the block runs, then back: lossless (every 16-bit value is a float32 one), so the forward inside is the
    float32 forward of exactly the weights the trainer holds, which the engine was given. Back means each
    parameter's own storage again, not a copy: under bf16_weights it is a view into DeepSpeed's flat buffer,
    which the optimizer writes the stepped weights into."""
    held = [(p, p.data) for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)]
    for p, data in held:
        p.data = data.float()
    try:
        yield
    finally:
        for p, data in held:
            p.data = data


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The weights a LoRA model computes with, under the base model's own names: each adapted layer's base
    weight plus its adapter's delta (peft's ``get_delta_weight``: B·A·alpha/r). What the engine is synced with
    and what ``save_pretrained`` writes as a plain HF checkpoint; the model itself is not changed. Tensors the
    base shares (tied embeddings) stay shared, so the tied copy is dropped on save as before."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {name: m.get_delta_weight(m.active_adapters[0]) for name, m in base.named_modules()
              if isinstance(m, LoraLayer) and m.active_adapters}
    out: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        owner, _, leaf = key.rpartition(".base_layer.")
        if owner:
            key = f"{owner}.{leaf}"
            if leaf == "weight" and owner in deltas:  # in float32: a 16-bit base would round the adapter's delta
                value = value.float() + deltas[owner].float()
        out[key] = value.detach()
    if any(v.dtype != torch.float32 for v in out.values()):  # a 16-bit base: the engine gets float32 throughout,
        done: dict[int, torch.Tensor] = {}  # exactly the weights the trainer computes with (tied ones stay shared)
        out = {k: done.setdefault(v.data_ptr(), v.float()) for k, v in out.items()}
    return out

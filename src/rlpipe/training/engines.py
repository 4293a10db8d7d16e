"""The trainer's models and DeepSpeed engines: the process group, the policy's and the critic's engines (torch's
AdamW, ZeRO, bf16 autocast or bf16 weights), the frozen reference model, and activation checkpointing.

:class:`EngineSetup` is a part of :class:`rlpipe.training.trainer.PolicyTrainer` (it reads the trainer's ``cfg``,
``model_dir``, ``ref_model_dir``, ``seed``, ``gas``, ``world`` and ``device``). deepspeed is imported inside the
functions, never at module import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from rlpipe.net import free_port
from rlpipe.training.checkpoint import RecyclingWrites
from rlpipe.training.head import check_chunked_head
from rlpipe.training.packing import check_packing

__all__ = ["EngineSetup", "checkpoint_activations", "init_distributed"]


def init_distributed() -> tuple[int, int]:
    """Initialise torch.distributed (gloo on CPU, nccl on CUDA) once; (rank, world_size).

    A single process needs the launcher's variables or DeepSpeed looks for MPI: set them.
    """
    import deepspeed
    import torch.distributed as dist

    # Also when torch.distributed is already up (an in-process vLLM engine starts a 1-process
    # group): DeepSpeed still insists on LOCAL_RANK.
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def checkpoint_activations(model: Any) -> None:
    """transformers' gradient checkpointing, non-reentrant (the reentrant form needs an input that requires
    grad, which a frozen-embedding LoRA model does not have); the KV cache is off, as it must be with it."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


class EngineSetup:
    """Building the trainer's models and engines (part of ``PolicyTrainer``)."""

    def _base_dtype(self, src: str) -> torch.dtype:
        """float32, but LoRA keeps the frozen base in 16 bits: nothing optimizes those weights, so no float32
        master copy is needed, and the base takes half the memory (the adapters stay float32, peft). A 16-bit
        checkpoint stays in its own dtype, under fp32 too, where each layer computes in float32 from its 16-bit
        weight (:func:`upcast_frozen`: the same numbers as a float32 copy, every 16-bit value being a float32
        one); under bf16 a float32 checkpoint is held in bfloat16 as well, as TRL and OpenRLHF load it."""
        if not self.cfg.lora:  # bf16_weights: rounded once here (as DeepSpeed's cast would), half the memory at start
            return torch.bfloat16 if self.cfg.precision == "bf16_weights" else torch.float32
        saved = json.loads((Path(src) / "config.json").read_text())
        named = saved.get("dtype") or saved.get("torch_dtype")
        if named in ("float16", "bfloat16"):
            return getattr(torch, named)
        return torch.bfloat16 if self.cfg.precision == "bf16" else torch.float32

    def _reference(self) -> Any:
        """The frozen reference model. Under bf16 it is kept in the checkpoint's own dtype (a 16-bit checkpoint
        takes half the memory of a float32 copy; its forward runs under the same autocast as the policy's);
        under bf16_weights in bfloat16, as the policy; under fp32, in float32 as the policy."""
        from transformers import AutoModelForCausalLM

        src = self.ref_model_dir or self.model_dir
        dtype = {"bf16": "auto", "bf16_weights": torch.bfloat16}.get(self.cfg.precision, torch.float32)
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
        ref.eval().requires_grad_(False)
        if self.cfg.pack_sequences:
            check_packing(ref, src, self.cfg.share_prompts)
        if self.cfg.logits_chunk:
            check_chunked_head(ref, src)
        return ref.to(self.device)

    def _engine(self, model: Any, lr: float, grad_clip: float) -> Any:
        import deepspeed
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        # torch's fused AdamW (one kernel per tensor, CPU and CUDA): several times faster than the default
        # single-tensor loop (benchmarks/profile_update.py); TRL's default too.
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
        ds_config = {
            "train_batch_size": self.cfg.batch_size,
            "train_micro_batch_size_per_gpu": self.cfg.micro_batch_size,
            "gradient_accumulation_steps": self.gas,
            # ZeRO 0: the trainer clips with the norm it computes anyway (_step); DeepSpeed's own clipping would
            # compute it a second time and all-reduce it, even on one rank. ZeRO 1/2 clip in DeepSpeed's optimizer.
            "gradient_clipping": grad_clip if self.cfg.zero_stage > 0 else 0.0,
            "zero_optimization": self._zero_config(),
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if self.cfg.offload_optimizer:  # torch's AdamW on the CPU partitions (DeepSpeedCPUAdam would compile an op)
            ds_config["zero_force_ds_cpu_optimizer"] = False
        if self.cfg.precision == "bf16_weights":
            # The module cast to bfloat16; float32 masters, gradient accumulation and moments in DeepSpeed's bf16
            # optimizer (stage 1: BF16_Optimizer; 2/3: ZeRO's), which skips a step whose gradient norm is not finite.
            ds_config["bf16"] = {"enabled": True}
            ds_config["data_types"] = {"grad_accum_dtype": "fp32"}
            ds_config["communication_data_type"] = "fp32"  # ranks reduce the float32 gradients (DeepSpeed: bf16)
        elif self.cfg.precision == "bf16":
            # DeepSpeed turns an outer torch.autocast off inside its engine's forward unless this section asks for it
            # (seen on CUDA: the forward ran in float32). No lower-precision modules: gradients reduce in float32.
            ds_config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        if isinstance(engine.checkpoint_engine, TorchCheckpointEngine):
            engine.checkpoint_engine = RecyclingWrites(engine.checkpoint_engine)
        if self.world == 1 and self.cfg.zero_stage == 0:
            # One rank, no ZeRO partitions: nothing to reduce, but DeepSpeed would still flatten, all-reduce and
            # copy back every gradient after each backward.
            engine.enable_backward_allreduce = False
        return engine

    def _zero_config(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.cfg.zero_stage}
        if self.cfg.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        return zero

    def _build_critic(self) -> Any:
        """The policy's trunk with a scalar head (HF token classification, 1 label, no dropout)."""
        from transformers import AutoConfig, AutoModelForTokenClassification

        src = self.cfg.critic.model or self.model_dir
        config = AutoConfig.from_pretrained(src, num_labels=1)
        config.classifier_dropout = 0.0  # else 0.1: noisy values
        # The head is new: seed its init so every rank (and a rerun) starts from the same critic.
        torch.manual_seed(self.seed + 17)
        critic = AutoModelForTokenClassification.from_pretrained(src, config=config, dtype=torch.float32)
        torch.manual_seed(self.seed)
        if self.cfg.gradient_checkpointing:
            checkpoint_activations(critic)
        return critic

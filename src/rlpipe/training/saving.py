"""A trainer's save points and their resume: HF weights + tokenizer, DeepSpeed's optimizer state (the policy's
and the critic's), the trainer state and the RNG, each file written over a spare save point's where one is given.

:class:`Saving` is a part of :class:`rlpipe.training.trainer.PolicyTrainer`.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rlpipe.storage.weights import file_weights_sha256, weights_sha256
from rlpipe.training.checkpoint import (
    ADAPTER, TRAINER_STATE, RecyclingSafetensors, RecyclingWrites, Spare, read_trainer_state, rng_state, set_rng_state,
)
from rlpipe.training.lora import merged_state_dict

__all__ = ["Saving"]


class Saving:
    """Save points of the trainer (part of ``PolicyTrainer``)."""

    @property
    def module(self) -> Any:
        """The policy model the engine trains (peft-wrapped under LoRA)."""
        return self.engine.module

    def export_weights(self, folder: str | Path, spare: Spare | str | Path | None = None) -> str:
        """HF weights + tokenizer (rank 0); returns the sha256 of the saved safetensors (``weights_sha256``).
        ``spare``: an earlier save point no longer needed, whose safetensors files are written over."""
        folder = Path(folder)
        # ZeRO-3: each rank holds 1/N of every weight; all ranks gather them layer by layer onto rank 0.
        gathered = self.engine._zero3_consolidated_16bit_state_dict() if self.cfg.zero_stage == 3 else None
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            with RecyclingSafetensors(folder, Spare.of(spare)) as files:
                if self.cfg.lora:  # the engine computes with the merged weights: a plain HF checkpoint of them
                    self.engine.module.get_base_model().save_pretrained(
                        folder, state_dict=merged_state_dict(self.engine.module), safe_serialization=True)
                else:
                    self.engine.module.save_pretrained(folder, state_dict=gathered, safe_serialization=True)
            self.tokenizer.save_pretrained(folder)
            digest = files.digest() or file_weights_sha256(folder)
        else:
            digest = ""
        if self.world > 1:
            import torch.distributed as dist

            box = [digest]
            dist.broadcast_object_list(box, src=0)
            digest = box[0]
        return digest

    def save(self, folder: str | Path, extra_state: dict[str, Any] | None = None, spare: str | Path | None = None) -> str:
        """A resumable checkpoint: HF weights + tokenizer + DeepSpeed optimizer state (+ the critic's) + trainer state.
        ``spare``: an earlier save point no longer needed, whose files are written over (RecyclingSafetensors for the
        weights, RecyclingWrites for DeepSpeed's)."""
        folder, spare = Path(folder), Spare.of(spare)  # one Spare: this process's maps read once per save
        digest = self.export_weights(folder, spare)
        if self.cfg.lora and self.rank == 0:  # what a resume puts back on the start model's base weights
            self.engine.module.save_pretrained(folder / ADAPTER, safe_serialization=True)
        with _module_left_out(self.engine):  # the HF weights above are the module's: not written twice
            _recycling(self.engine, folder, spare).save_checkpoint(str(folder / "deepspeed"), tag="state", save_latest=False)
        if self.critic is not None:
            _recycling(self.critic, folder, spare).save_checkpoint(str(folder / "critic"), tag="state", save_latest=False)
        if self.rank == 0:
            state = dict(self.state) | (extra_state or {}) | {"weights_sha256": digest, "world_size": self.world}
            if self.cfg.lora:  # the adapter's hash from memory: an engine fed adapter/ must read the same tensors
                from peft import get_peft_model_state_dict

                state |= {"lora_base": str(self.model_dir),
                          "adapter_sha256": weights_sha256(get_peft_model_state_dict(self.engine.module))}
            (folder / TRAINER_STATE).write_text(json.dumps(state, indent=2, sort_keys=True, default=str))
            torch.save(rng_state(), folder / "rng.pt")
        return digest

    def _load_state(self, folder: Path) -> None:
        saved = read_trainer_state(folder)
        if self.cfg.zero_stage > 0 and int(saved.get("world_size", self.world)) != self.world:
            raise ValueError(f"{folder} was saved by {saved['world_size']} rank(s) with ZeRO stage {self.cfg.zero_stage}, "
                             f"which splits the optimizer state by rank; resume it with {saved['world_size']} rank(s)")
        path, _ = self.engine.load_checkpoint(str(folder / "deepspeed"), tag="state", load_optimizer_states=True,
                                              custom_load_fn=_module_from_hf_weights)
        if path is None:
            raise FileNotFoundError(f"{folder}/deepspeed holds no DeepSpeed checkpoint 'state'")
        if self.critic is not None:
            path, _ = self.critic.load_checkpoint(str(folder / "critic"), tag="state", load_optimizer_states=True)
            if path is None:
                raise FileNotFoundError(f"{folder}/critic holds no critic checkpoint; was it saved by a run without a critic?")
        self.state = saved
        if "kl_controller" in self.state:
            self.kl_ctl.load_state_dict(self.state["kl_controller"])
        rng = folder / "rng.pt"
        if rng.exists():
            set_rng_state(torch.load(rng, weights_only=False))


def _recycling(engine: Any, folder: Path, spare: Spare | None) -> Any:
    if isinstance(engine.checkpoint_engine, RecyclingWrites):
        engine.checkpoint_engine.recycle(folder, spare)
    return engine


@contextmanager
def _module_left_out(engine: Any):
    """DeepSpeed's checkpoint without the module's weights. They are the HF weights saved beside it, from
    which the trainer is built on resume (``from_pretrained(resume_dir)``), so writing them again cost a
    third of every save (14 of 41 MB at the demo size). The optimizer state (with any fp32 master weights)
    is saved as before."""
    engine.module_state_dict = lambda *args, **kwargs: {}
    try:
        yield
    finally:
        del engine.module_state_dict


def _module_from_hf_weights(src: dict[str, Any], dst: Any) -> None:
    """Loads the module part of a DeepSpeed checkpoint: nothing when it was left out (the trainer was built
    from the same folder's HF weights, ``from_pretrained(resume_dir)``); the weights themselves from a state
    saved before they were left out."""
    if src:
        dst.load_state_dict(src)

"""A trainer's save points and their resume: HF weights + tokenizer, DeepSpeed's optimizer state (the policy's
and the critic's), the trainer state and the RNG, each file written over a spare save point's where one is given.

:class:`Saving` is a part of :class:`rlpipe.training.trainer.PolicyTrainer`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rlpipe.storage.weights import weights_digest
from rlpipe.threads import done, on_thread
from rlpipe.training.checkpoint import (
    ADAPTER, TRAINER_STATE, PageBuffer, RecyclingSafetensors, RecyclingWrites, Spare, hf_checkpoint_tensors,
    read_trainer_state, rng_state, set_rng_state,
)
from rlpipe.training.lora import merged_state_dict

__all__ = ["Saving"]


class Saving:
    """Save points of the trainer (part of ``PolicyTrainer``)."""

    # The exported weights are assembled here and written past the page cache; kept from one save to the next.
    _weights_buffer: PageBuffer | None = None

    @property
    def module(self) -> Any:
        """The policy model the engine trains (peft-wrapped under LoRA)."""
        return self.engine.module

    def policy_tensors(self) -> tuple[str, dict[str, torch.Tensor]]:
        """The policy's weights as an engine takes them and ``save_pretrained`` writes them (HF names, tied copies
        dropped, weight conversions reverted; under LoRA the merged weights), and their digest: computed once per
        update and kept until the next one (:meth:`PolicyTrainer.update` drops it). The tensors are the module's own
        (no copy): an engine copies them in. Rank 0's; other ranks get the digest and an empty dict."""
        digest, tensors = self.handoff()
        return digest.result(), tensors

    def handoff(self) -> tuple[Future, dict[str, torch.Tensor]]:
        """:meth:`policy_tensors` without waiting for the hash: the tensors now, their digest as a future. With one
        rank the hash runs on a thread of its own (one core) while the caller hands the tensors to an engine: the
        hash reads them, the engine copies them, neither writes. With several it is taken here and broadcast, in
        step on every rank."""
        if self._handoff is None:
            if self.cfg.zero_stage == 3:  # each rank holds 1/N of every weight: all ranks gather them onto rank 0
                raw = self.engine._zero3_consolidated_16bit_state_dict()
            else:
                raw = None if self.rank else (merged_state_dict(self.engine.module) if self.cfg.lora
                                              else self.engine.module.state_dict())
            tensors = hf_checkpoint_tensors(self._saved_model(), raw) if self.rank == 0 else {}
            self._raw_state = raw  # what save_pretrained is given: it drops tied copies and reverts conversions itself
            if self.world == 1:
                digest = on_thread(lambda: weights_digest(tensors), "rlpipe-weights-hash")
            else:
                import torch.distributed as dist

                box = [weights_digest(tensors) if self.rank == 0 else ""]
                dist.broadcast_object_list(box, src=0)
                digest = done(box[0])
            self._handoff = (digest, tensors)
        return self._handoff

    def _saved_model(self) -> Any:
        """The HF model whose checkpoint the engine holds: the base model under LoRA (its merged weights)."""
        return self.engine.module.get_base_model() if self.cfg.lora else self.engine.module

    def export_weights(self, folder: str | Path, spare: Spare | str | Path | None = None) -> str:
        """HF weights + tokenizer (rank 0); returns the digest of the weights written, which is
        :meth:`policy_tensors`' (hashed once per update, from the tensors written). ``spare``: an earlier save point
        no longer needed, whose safetensors files are written over."""
        folder = Path(folder)
        digest, _ = self.policy_tensors()
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            if self._weights_buffer is None:
                self._weights_buffer = PageBuffer()
            with RecyclingSafetensors(folder, Spare.of(spare), self._weights_buffer):
                self._saved_model().save_pretrained(folder, state_dict=self._raw_state, safe_serialization=True)
            self.tokenizer.save_pretrained(folder)
        return digest

    def save(self, folder: str | Path, extra_state: dict[str, Any] | None = None, spare: str | Path | None = None) -> str:
        """A resumable checkpoint: HF weights + tokenizer + DeepSpeed optimizer state (+ the critic's) + trainer state.
        ``spare``: an earlier save point no longer needed, whose files are written over (RecyclingSafetensors for the
        weights, RecyclingWrites for DeepSpeed's)."""
        digest, write = self.plan_save(folder, extra_state, spare)
        write()
        return digest.result()

    def plan_save(self, folder: str | Path, extra_state: dict[str, Any] | None = None, spare: str | Path | None = None,
                  midway: Callable[[], None] | None = None) -> tuple[Future, Callable[[], None]]:
        """A save in two halves: what must be taken now (the trainer state, the RNG: the caller's thread goes on
        using the RNG), and the writing, returned to run now or on another thread, while nothing changes the
        weights or the optimizer (the next update waits for it). The weights' hash is a future (:meth:`handoff`'s):
        the writing records it, the caller need not wait for it. ``midway``: called between the HF weights and the
        optimizer state (a test's kill point)."""
        folder = Path(folder)
        digest, _ = self.handoff()
        state: dict[str, Any] = {}
        if self.rank == 0:
            state = dict(self.state) | (extra_state or {}) | {"world_size": self.world}
            if self.cfg.lora:  # the adapter's hash from memory: an engine fed adapter/ must read the same tensors
                state |= {"lora_base": str(self.model_dir), "adapter_sha256": self.adapter_sha256()}
        state = json.loads(json.dumps(state, default=str))  # a copy, as it is now
        rng = rng_state()

        def write() -> None:
            if self.rank == 0:
                state["weights_sha256"] = digest.result()
            the_spare = Spare.of(spare)  # one Spare: this process's maps read once per save
            self.export_weights(folder, the_spare)
            if self.cfg.lora and self.rank == 0:  # what a resume puts back on the start model's base weights
                self.engine.module.save_pretrained(folder / ADAPTER, safe_serialization=True)
            if midway is not None:
                midway()
            with _module_left_out(self.engine):  # the HF weights above are the module's: not written twice
                _recycling(self.engine, folder, the_spare).save_checkpoint(str(folder / "deepspeed"), tag="state",
                                                                           save_latest=False)
            if self.critic is not None:
                _recycling(self.critic, folder, the_spare).save_checkpoint(str(folder / "critic"), tag="state",
                                                                           save_latest=False)
            if self.rank == 0:  # last: a folder without it is no save point
                torch.save(rng, folder / "rng.pt")
                (folder / TRAINER_STATE).write_text(json.dumps(state, indent=2, sort_keys=True))

        return digest, write

    def adapter_sha256(self) -> str:
        """The digest of the LoRA adapter's tensors, from memory (what an engine fed the adapter must have read)."""
        from peft import get_peft_model_state_dict

        return weights_digest(get_peft_model_state_dict(self.engine.module))

    def export_adapter(self, folder: str | Path) -> str:
        """Only the LoRA adapter (peft's layout, megabytes), for an engine that serves the start weights with it;
        returns its :meth:`adapter_sha256`."""
        if self.rank == 0:
            self.engine.module.save_pretrained(Path(folder), safe_serialization=True)
        return self.adapter_sha256()

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

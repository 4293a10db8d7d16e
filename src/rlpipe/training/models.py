"""Resolve a model spec from the config into (model, tokenizer).

Specs: ``tiny`` (rlpipe's own small Qwen2, built from ``model``), a local HF folder, or an MLflow
registry URI ``models:/NAME@ALIAS`` / ``models:/NAME/VERSION`` whose source is a local folder or
an ``s3://`` prefix (fetched once into ``$RLPIPE_HOME/cache``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from rlpipe.config import RunConfig, Settings
from rlpipe.training.checkpoint import load_checkpoint
from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

__all__ = ["load_model", "resolve_source", "fetch_source"]


def resolve_source(spec: str, s: Settings, cfg: RunConfig | None = None) -> str:
    """The checkpoint URI behind a ``models:/`` spec (other specs are returned as they are)."""
    if not spec.startswith("models:/"):
        return spec
    from rlpipe.tracking.mlflow_utils import Tracker

    ref = spec[len("models:/"):]
    tracker = Tracker(s, cfg)
    if "@" in ref:
        name, alias = ref.split("@", 1)
        mv = tracker.version_by_alias(name, alias)  # "latest" maps to MLflow's alias "last"
        if mv is None:
            raise LookupError(f"{spec}: no version of model {name!r} has alias {alias!r} in {tracker.uri}")
        return mv.source
    name, version = ref.rsplit("/", 1)
    return tracker.client.get_model_version(name, version).source


def fetch_source(source: str, s: Settings) -> Path:
    """A local folder holding the checkpoint at ``source`` (downloaded once if it is on S3)."""
    if source.startswith("s3://"):
        from rlpipe.storage.store import open_store

        bucket, _, key = source[len("s3://"):].partition("/")
        dest = (s.home / "cache" / hashlib.sha256(source.encode()).hexdigest()[:16]).resolve()
        if not (dest / "config.json").exists():
            open_store(f"s3://{bucket}", s).download_dir(key, dest)
        return dest
    path = Path(source.removeprefix("file://"))
    if not path.exists():
        raise FileNotFoundError(f"model source {source} does not exist")
    return path


def load_model(spec: str, cfg: RunConfig, s: Settings, dtype: torch.dtype = torch.float32) -> tuple[Any, Any, str]:
    """(model, tokenizer, resolved source) for a spec; ``tiny`` gives a freshly initialised model."""
    if spec == "tiny":
        tok = build_char_tokenizer()
        return build_tiny_model(cfg.model, tok, seed=cfg.seed, dtype=dtype), tok, "tiny"
    source = resolve_source(spec, s, cfg)
    model, tok, _ = load_checkpoint(fetch_source(source, s), dtype=dtype)
    return model, tok, source


def version_label(spec: str, s: Settings, cfg: RunConfig | None = None) -> str:
    """'NAME/vN' for a registry spec (the version an alias points at now), else the spec itself."""
    if not spec.startswith("models:/"):
        return spec
    from rlpipe.tracking.mlflow_utils import Tracker

    ref = spec[len("models:/"):]
    if "@" in ref:
        name, alias = ref.split("@", 1)
        mv = Tracker(s, cfg).version_by_alias(name, alias)
        return f"{name}/v{mv.version}" if mv else spec
    return ref.replace("/", "/v", 1) if not ref.rsplit("/", 1)[-1].startswith("v") else ref


def load_reward_model(spec: str, s: Settings, cfg: RunConfig | None = None, batch_size: int = 256) -> Any:
    """A :class:`~rlpipe.training.reward_model.RewardScorer` for a reward-model spec (folder or models:/…)."""
    from rlpipe.training.reward_model import RewardScorer

    folder = fetch_source(resolve_source(spec, s, cfg), s)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{spec}: {folder} holds no model (config.json missing)")
    label = version_label(spec, s, cfg)
    scorer = RewardScorer(folder, version="", batch_size=batch_size)
    scorer.version = f"{label}@{scorer.weights_sha256[:12]}"
    return scorer

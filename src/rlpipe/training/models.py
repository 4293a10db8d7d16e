"""Resolve a model spec from the config into (model, tokenizer).

Specs: ``tiny`` (rlpipe's own small Qwen2, built from ``model``), a local HF folder, a hub id
(``Qwen/Qwen2.5-0.5B-Instruct``, optionally ``@revision``) found in the local Hugging Face cache, or an MLflow
registry URI ``models:/NAME@ALIAS`` / ``models:/NAME/VERSION`` whose source is a local folder or
an ``s3://`` prefix (fetched once into ``$RLPIPE_HOME/cache``).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import torch

from rlpipe.config import RunConfig, Settings
from rlpipe.training.checkpoint import load_checkpoint
from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

__all__ = ["check_model_folder", "fetch_source", "hub_snapshot", "load_model", "resolve_source"]


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
        if not _HUB_ID.fullmatch(source):
            raise FileNotFoundError(f"model source {source} does not exist")
        path = hub_snapshot(source)
    check_model_folder(path, source)
    return path


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?(@[\w.-]+)?")


def hub_snapshot(repo_id: str) -> Path:
    """The local folder of a hub id (``org/name`` or ``org/name@revision``) from the Hugging Face cache
    (``HF_HOME`` / ``HF_HUB_CACHE``). Nothing is downloaded at run time: a run's model is fetched beforehand."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    name, _, revision = repo_id.partition("@")
    try:
        return Path(snapshot_download(name, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local folder nor in the Hugging Face cache ({HF_HUB_CACHE}): rlpipe "
            f"does not download at run time. Fetch it once where the hub is reachable: `hf download {name}"
            f"{' --revision ' + revision if revision else ''}` (HF_HOME picks the cache), or give a local folder"
        ) from e


def model_context(folder: str | Path) -> int | None:
    """A checkpoint's own context length (``max_position_embeddings`` or its older names), None if it names none."""
    import json

    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg) if "max_position_embeddings" not in cfg else cfg
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


def check_model_folder(folder: Path, spec: str) -> None:
    """Refuse, before anything slow starts, a folder that is not a causal LM or whose tokenizer does not fit its
    embeddings (naming the file and the fix)."""
    import json

    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{spec}: {folder} holds no model (config.json missing); give a Hugging Face "
                                "causal-LM folder (config.json, *.safetensors, tokenizer files)")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or []
    # A reward model or critic rlpipe saved is the same trunk with a scalar head (*ForTokenClassification).
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForTokenClassification", "ForSequenceClassification"))
                         for a in archs):
        raise ValueError(f"{spec}: {cfg_path} describes {archs}, not a causal language model; rlpipe trains "
                         "*ForCausalLM checkpoints (a base or instruct LM folder)")
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    tok_file = folder / "tokenizer.json"
    if vocab and tok_file.exists():
        tok = json.loads(tok_file.read_text())
        ids = list(((tok.get("model") or {}).get("vocab") or {}).values())
        ids += [t["id"] for t in tok.get("added_tokens") or []]
        top = max((i for i in ids if isinstance(i, int)), default=-1)
        if top >= vocab:
            raise ValueError(f"{spec}: the tokenizer ({tok_file}) has token id {top}, the model's embeddings only "
                             f"{vocab} rows (config.json vocab_size): they belong to different models; use the "
                             "checkpoint's own tokenizer, or resize the embeddings and save the model again")


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

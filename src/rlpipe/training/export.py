"""A model version as a plain Hugging Face folder (``rlpipe export``): what another tool loads, without rlpipe's
resumable state (DeepSpeed's optimizer, RNG, trainer state)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rlpipe.training.checkpoint import ADAPTER, TRAINER_STATE

__all__ = ["export_model"]
_STATE = {TRAINER_STATE, "rng.pt", "deepspeed", "critic", ADAPTER}


def export_model(folder: str | Path, out: str | Path, merge: bool = False) -> Path:
    """Copy the HF part of a save point ``folder`` to ``out``. A LoRA save point holds the merged weights (the
    engine is synced with them) and ``adapter/``: ``merge`` exports the former, else the adapter, whose
    ``adapter_config.json`` then names the base model the run started from."""
    folder, out = Path(folder), Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; give a new folder")
    adapter = folder / ADAPTER
    state = json.loads((folder / TRAINER_STATE).read_text()) if (folder / TRAINER_STATE).exists() else {}
    if not merge and adapter.is_dir():
        shutil.copytree(adapter, out, dirs_exist_ok=True)
        cfg_path = out / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        if state.get("lora_base"):
            cfg["base_model_name_or_path"] = state["lora_base"]
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
        return out
    out.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name not in _STATE and item.is_file():
            shutil.copy2(item, out / item.name)
    return out

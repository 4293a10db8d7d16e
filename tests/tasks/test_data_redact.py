"""data.redact at the dataset stage: the prompt set the store keeps (and the policy reads) is de-identified."""

import json

from rlpipe.config import load_config
from rlpipe.storage import PROMPT_SCHEMA, open_store
from tasks.data import prepare_dataset

EMAIL = "jane.doe@uni-bonn.de"


def test_stored_dataset_is_redacted_only_with_the_flag(tmp_path):
    p = tmp_path / "mine.jsonl"
    rows = [{"id": "a", "prompt": f"{EMAIL} asks: 1+1=", "ground_truth": "2"},
            {"id": "b", "prompt": "2+2=", "ground_truth": "4", "split": "test"}]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    stored = {}
    for flag in ("false", "true"):
        ds = prepare_dataset.fn(load_config(None, [f"task.dataset={p}", f"data.redact={flag}"]))
        stored[flag] = (ds["version"], open_store().read_stage(ds["prefix"], schema=PROMPT_SCHEMA).column("prompt").to_pylist())
    assert stored["false"][1] == [f"{EMAIL} asks: 1+1=", "2+2="]
    assert stored["true"][1] == ["[EMAIL] asks: 1+1=", "2+2="]
    assert stored["true"][0] != stored["false"][0]  # another content, another dataset version

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlpipe.rollout.base import SamplingConfig, WeightSyncError
from rlpipe.rollout.engines import get_engine
from rlpipe.runtime import RunServices, register_services, stop_services
from rlpipe.training.checkpoint import file_weights_sha256
from tasks.rl import sync_weights


def perturbed(src, dst, scale=1.01):
    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    w = {k: (v * scale if v.dtype.is_floating_point else v) for k, v in w.items()}
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("kind", ["vllm", "hf"])
def test_reload_in_place_is_hash_checked(kind, tiny_checkpoint, tmp_path):
    engine = get_engine(kind, tiny_checkpoint, max_model_len=64)
    assert engine.weights_sha256() == file_weights_sha256(tiny_checkpoint)
    same = engine  # no restart: the process keeps one engine per architecture
    new = perturbed(tiny_checkpoint, tmp_path / "new")
    assert engine.load_weights(new) == file_weights_sha256(new) != file_weights_sha256(tiny_checkpoint)
    assert get_engine(kind, tiny_checkpoint, max_model_len=64) is same
    # The reloaded weights are really in use: greedy output matches HF on the folder loaded last.
    from rlpipe.training.checkpoint import load_checkpoint
    from rlpipe.training.sft import greedy_answers

    prompts = ["12+34=", "77+18=", "50+50="]
    ids = [engine.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=6)
    for folder in (new, perturbed(tiny_checkpoint, tmp_path / "far", scale=0.5), tiny_checkpoint):
        engine.load_weights(folder)
        model, tok, _ = load_checkpoint(folder)
        assert [o[0].text for o in engine.generate(ids, greedy)] == greedy_answers(model, tok, prompts, 6)


def test_sync_task_fails_on_a_hash_mismatch(tiny_checkpoint, tmp_path):
    engine = get_engine("hf", tiny_checkpoint, max_model_len=64)
    register_services(RunServices("sync-test", engine, None, None, engine.tokenizer, [], [], {}))
    try:
        ok = sync_weights.fn(None, "sync-test", 0, {"state_dir": str(tiny_checkpoint),
                                                    "weights_sha256": file_weights_sha256(tiny_checkpoint)})
        assert ok["policy_version"] == file_weights_sha256(tiny_checkpoint)
        # The trainer said it exported A, but the folder holds B (a stale or partial copy): never ignored.
        stale = perturbed(tiny_checkpoint, tmp_path / "stale")
        with pytest.raises(WeightSyncError, match="holds"):
            sync_weights.fn(None, "sync-test", 0, {"state_dir": str(stale), "weights_sha256": file_weights_sha256(tiny_checkpoint)})
        broken = tmp_path / "empty"
        broken.mkdir()
        with pytest.raises(WeightSyncError, match="no \\*.safetensors"):
            sync_weights.fn(None, "sync-test", 0, {"state_dir": str(broken), "weights_sha256": "x"})
    finally:
        stop_services("sync-test")

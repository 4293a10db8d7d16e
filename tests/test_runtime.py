"""A run's context (resolved once, the config never rewritten) and how its services are assembled."""

import json

import pytest

from rlpipe.config import RunConfig, settings
from rlpipe.runtime import RunContext, forget_context, register_context, run_context
from rlpipe.runtime.assembly import adapter_sync, context_length, ground_truths, split_rows


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path))
    return tmp_path


def test_the_context_is_resolved_once_and_holds_the_config_as_given(home, tmp_path):
    policy, ref = tmp_path / "policy", tmp_path / "ref"
    for folder in (policy, ref):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    config = RunConfig.model_validate({"task": {"policy_model": str(policy), "ref_model": str(ref)}})
    ctx = register_context(RunContext.resolve(config, "rl-ctx"))
    try:
        assert run_context("rl-ctx") is ctx and run_context("rl-ctx", config) is ctx
        assert run_context("rl-ctx", config.model_copy(deep=True)) is ctx  # an equal config: the same run
        assert ctx.folder.path == settings().run_dir("rl-ctx") and ctx.store.url("").startswith(str(home))
        assert ctx.fingerprint == config.fingerprint() and len(ctx.resume_fingerprint) == 64
        models = ctx.resolve_models()
        assert (models.policy, models.ref, models.critic) == (str(policy), str(ref), None)
        assert ctx.resolve_models() is models and ctx.config.task.ref_model == str(ref)  # never rewritten
    finally:
        forget_context("rl-ctx")
    with pytest.raises(RuntimeError, match="no context in this process"):
        run_context("rl-ctx")


def test_an_untrained_policy_is_refused_with_the_fix(home):
    ctx = RunContext.resolve(RunConfig.model_validate({"task": {"policy_model": "tiny"}}), "rl-tiny")
    with pytest.raises(ValueError, match="untrained model: run `rlpipe sft` first"):
        ctx.resolve_models()


def test_splits_ground_truths_and_adapter_syncs(home):
    rows = [{"id": "a", "split": "train", "ground_truth": "1", "tests": None},
            {"id": "b", "split": "test", "ground_truth": None, "tests": "assert f() == 1"},
            {"id": "c", "split": "test", "ground_truth": "3", "tests": None}]
    config = RunConfig.model_validate({"train": {"eval_size": 1}})
    assert [r["id"] for r in split_rows(config, rows, "test")] == ["b"]  # cut to train.eval_size
    assert ground_truths(rows) == {"a": "1", "b": "assert f() == 1", "c": "3"}
    lora = RunConfig.model_validate({"train": {"lora": {"r": 4}}, "rollout": {"engine": "vllm"}})
    assert adapter_sync(RunContext.resolve(lora, "rl-a")) and not adapter_sync(RunContext.resolve(RunConfig(), "rl-b"))
    remote = lora.model_copy(deep=True)
    remote.services.trainer = "http://127.0.0.1:9"
    assert not adapter_sync(RunContext.resolve(remote, "rl-c"))  # a trainer service sends the merged weights


def test_the_engine_context_fits_the_prompts_and_never_exceeds_the_models(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    rows = [{"prompt": "x" * 20}]
    config = RunConfig.model_validate({"rollout": {"max_new_tokens": 8}})
    assert context_length(config, rows) == 20 * 4 + 8 + 16
    assert context_length(RunConfig.model_validate({"rollout": {"max_new_tokens": 60}}), rows, str(tmp_path)) == 128
    with pytest.raises(ValueError, match="rollout.max_model_len 256 exceeds the model's own context \\(128"):
        context_length(RunConfig.model_validate({"rollout": {"max_model_len": 256}}), rows, str(tmp_path))

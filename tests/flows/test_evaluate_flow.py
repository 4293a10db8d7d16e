"""The evaluate flow: a registered version on a split, beside a baseline alias, logged to MLflow; the
promotion alias moves only on the validation split and only to a better model.

The prompt set is made so that the two models' scores are known in advance: its references are model A's
own greedy answers (verifier ``exact``), so A scores 1.0 and B, another model, scores less."""

import json

import pytest

from rlpipe.config import RunConfig, settings
from rlpipe.tracking.mlflow_utils import Tracker

NAME = "evaltest"


@pytest.fixture(scope="module")
def untrained_checkpoint(tmp_path_factory):
    from rlpipe.training.checkpoint import save_checkpoint
    from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

    cfg = RunConfig.model_validate({"model": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}})
    tok = build_char_tokenizer()
    folder = tmp_path_factory.mktemp("untrained")
    save_checkpoint(folder, build_tiny_model(cfg.model, tok, seed=1), tok, trainer_state={"kind": "init"})
    return folder


def own_answers_task(path, checkpoint, max_new_tokens=6):
    """Arithmetic prompts whose references are ``checkpoint``'s greedy answers (rows it answers with
    whitespace only are left out: ``exact`` refuses an empty reference)."""
    from rlpipe.config import DataConfig
    from rlpipe.data import build_arithmetic
    from rlpipe.rollout.base import SamplingConfig
    from rlpipe.rollout.engines import new_engine
    from rlpipe.tokens import render_prompt
    from transformers import AutoTokenizer

    rows = build_arithmetic(DataConfig(test_size=24, validation_size=24, train_size=40)).to_pylist()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    engine = new_engine("hf", checkpoint, max_model_len=128, seed=0)
    try:
        outs = engine.generate([tok(render_prompt(tok, r["prompt"], r["chat"]), add_special_tokens=False)["input_ids"] for r in rows],
                               SamplingConfig(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    finally:
        engine.close()
    keep = [r | {"task": "exact", "ground_truth": o[0].text.strip()} for r, o in zip(rows, outs) if o[0].text.strip()]
    path.write_text("\n".join(json.dumps(r) for r in keep))
    return path


@pytest.fixture(scope="module")
def registered(tiny_checkpoint, untrained_checkpoint, tmp_path_factory):
    """models:/rlpipe-evaltest v1 = the tiny SFT checkpoint (A), v2 = an untrained model (B), each from an
    MLflow run that logged the config."""
    data = own_answers_task(tmp_path_factory.mktemp("evaldata") / "own.jsonl", tiny_checkpoint)
    cfg = RunConfig.model_validate({"task": {"name": NAME, "dataset": str(data)}, "tracking": {"experiment": NAME},
                                    "rollout": {"engine": "hf", "max_new_tokens": 6}, "reward": {"workers": 1}})
    tracker = Tracker(settings(), cfg)
    versions = []
    for k, folder in enumerate((tiny_checkpoint, untrained_checkpoint)):
        rid = tracker.start_run(cfg, f"evaltest-src-{k}", "rl")
        versions.append(tracker.register_checkpoint(
            cfg.registered_model, str(folder), rid, rlpipe_run_id=f"evaltest-src-{k}", iteration=0,
            config_fingerprint=cfg.fingerprint(), dataset_version="d" * 64, weights_sha256=f"{k:064x}", aliases=()))
    return cfg, versions


def test_promotion_moves_only_to_a_better_model_on_validation(prefect_harness, registered):
    from flows.evaluate import evaluate

    cfg, (a, b) = registered
    name, tracker = cfg.registered_model, Tracker(settings(), cfg)
    # B first: no @best yet, so nothing to beat; config=None takes the config of B's MLflow run.
    first = evaluate(model=f"models:/{name}/{b.version}", promote_to="best")
    assert first["promoted"] and "no baseline" in first["reason"] and first["accuracy"] < 1.0
    assert tracker.version_by_alias(name, "best").version == b.version
    # A answers its own answers: 1.0 beats B's score, @best moves.
    second = evaluate(model=f"models:/{name}/{a.version}", promote_to="best")
    assert second["accuracy"] == 1.0 and second["baseline"] == {"alias": "best", "version": b.version, "accuracy": first["accuracy"]}
    assert second["promoted"] and tracker.version_by_alias(name, "best").version == a.version
    # B again: worse than @best (A) → @best stays; a tie would stay too.
    third = evaluate(model=f"models:/{name}/{b.version}", promote_to="best")
    assert not third["promoted"] and "stays" in third["reason"] and tracker.version_by_alias(name, "best").version == a.version
    # Reported in MLflow: the candidate's and the baseline's scores side by side, and a tag on the version.
    run = tracker.client.get_run(third["mlflow_run_id"])
    assert run.data.metrics["validation_accuracy"] == third["accuracy"]
    assert run.data.metrics["baseline_validation_accuracy"] == 1.0
    assert run.data.metrics["delta_validation_accuracy"] == pytest.approx(third["accuracy"] - 1.0)
    assert run.data.tags["rlpipe.kind"] == "evaluate" and run.data.tags["rlpipe.eval.baseline"] == f"@best = {name} v{a.version}"
    assert tracker.client.get_model_version(name, a.version).tags["eval_validation_accuracy"] == "1.000000"
    assert run.info.status == "FINISHED"


def test_test_split_reports_and_never_promotes(prefect_harness, registered):
    from flows.evaluate import evaluate

    cfg, (a, b) = registered
    name = cfg.registered_model
    with pytest.raises(ValueError, match="validation split only"):
        evaluate(model=f"models:/{name}/{b.version}", split="test", promote_to="champion")
    out = evaluate(model=f"models:/{name}/{a.version}", split="test", baseline=None)
    assert out["accuracy"] == 1.0 and out["baseline"]["accuracy"] is None and not out["promoted"]
    assert Tracker(settings(), cfg).version_by_alias(name, "champion") is None
    with pytest.raises(LookupError, match="register one first"):
        evaluate(model=f"models:/{name}@nosuchalias")


def test_cli_evaluate(prefect_harness, registered):
    from typer.testing import CliRunner

    from rlpipe.cli import app

    cfg, (a, _) = registered
    res = CliRunner().invoke(app, ["evaluate", f"models:/{cfg.registered_model}/{a.version}", "--split", "test", "--baseline", "none"])
    assert res.exit_code == 0, res.output
    assert "accuracy 1.000" in res.output
    summary = json.loads(open(res.stdout.strip().splitlines()[-1]).read())
    assert summary["kind"] == "evaluate" and summary["version"] == a.version
    bad = CliRunner().invoke(app, ["evaluate", f"models:/{cfg.registered_model}/{a.version}", "--split", "test", "--promote-to", "best"])
    assert bad.exit_code == 2 and "validation split only" in bad.output

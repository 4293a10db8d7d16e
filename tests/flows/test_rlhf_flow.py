"""RLHF end to end: rm-train registers a reward model with its lineage and statistics; a 2-iteration run
scores with it (normalised, mixed with a verifier) and reports true and reward-model scores side by
side; with the reward-model service down every sample is skipped, never scored 0."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlpipe.config import load_config, settings
from rlpipe.storage import TRAJECTORY_SCHEMA, open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.tracking.mlflow_utils import Tracker
from rlpipe.storage.weights import file_weights_digest
from tests.flows.test_train_flow import invoke


def _pairs(path: Path) -> Path:
    """Right answers over wrong ones on arithmetic prompts (the pairs a labeller would give), all splits."""
    rows = []
    for a in range(10, 40):
        for b in range(10, 22):
            split = "test" if b == 20 else "validation" if b == 21 else "train"
            rows.append({"id": f"{a}-{b}", "prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 37),
                         "split": split})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sets(name: str, *extra: str) -> list[str]:
    return [f"task.name={name}", f"tracking.experiment={name}", *extra]


@pytest.fixture(scope="module")
def reward_model(prefect_harness, tiny_checkpoint, tmp_path_factory):
    sets = _sets("rlhf", f"rm.dataset={_pairs(tmp_path_factory.mktemp('prefs') / 'prefs.jsonl')}",
                 f"rm.base_model={tiny_checkpoint}", "rm.steps=30", "rm.batch_size=16", "rm.micro_batch_size=8",
                 "rm.eval_every=10", "rm.warmup_steps=2", "rm.lr=1e-3")
    summary = invoke(["rm-train", "--run-id", "rm-flow"] + [x for s in sets for x in ("--set", s)])
    return sets, summary


def test_rm_train_registers_the_model_with_lineage_and_statistics(reward_model):
    sets, summary = reward_model
    assert summary["pairs"] == {"train": 300, "validation": 30, "test": 30}
    assert summary["rm_pair_accuracy"] is not None and summary["rm_test_pairs"] == 30
    cfg = load_config(None, sets)
    tracker = Tracker(settings(), cfg)
    best = tracker.version_by_alias("rlpipe-rlhf-rm", "best")
    last = tracker.version_by_alias("rlpipe-rlhf-rm", "latest")
    assert best.version == last.version == summary["registered_model"]["version"]
    tags = best.tags
    assert tags["dataset_version"] == summary["preference_version"] and tags["config_fingerprint"] == cfg.fingerprint()
    assert tags["base_model"] == str(load_config(None, sets + [f"rm.base_model={summary['base_model']}"]).rm.base_model)
    assert float(tags["reward_std"]) == pytest.approx(summary["reward_stats"]["std"], abs=1e-5)
    assert float(tags["validation_accuracy"]) == pytest.approx(summary["rm_validation_pair_accuracy"], abs=1e-5)
    assert tracker.client.get_registered_model("rlpipe-rlhf-rm").tags["rlpipe"] == "reward_model"


def _rl_sets(tiny_checkpoint, rm_version: str, iterations: int) -> list[str]:
    return _sets("rlhf", f"task.policy_model={tiny_checkpoint}", "task.dataset=builtin:arithmetic-rlhf",
                 "data.test_size=16", "data.validation_size=8", "data.train_size=64",
                 "reward.type=model", f"reward.model=models:/rlpipe-rlhf-rm/{rm_version}", "reward.normalize=true",
                 "reward.weights={model: 1.0, exact: 0.5}", "reward.workers=1", "rollout.engine=hf",
                 "rollout.batch_size=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4",
                 "train.batch_size=8", "train.micro_batch_size=4", f"train.total_iterations={iterations}",
                 "train.save_interval=1", "train.eval_interval=1", "train.lr=1e-4")


def test_two_ppo_rlhf_iterations_score_with_the_reward_model(reward_model, tiny_checkpoint):
    """Classic PPO-RLHF: a critic, the RM score normalised and mixed with a verifier, KL in the reward."""
    _, rm = reward_model
    sets = _rl_sets(tiny_checkpoint, rm["registered_model"]["version"], 2) + [
        "train.algorithm=ppo", "train.kl_coef=0.02", "train.kl_in=reward"]
    summary = invoke(["run", "--run-id", "rlhf-e2e"] + [x for s in sets for x in ("--set", s)])
    assert summary["iterations_done"] == 2 and summary["reward_type"] == "model"
    assert summary["reward_model_version"].startswith(f"rlpipe-rlhf-rm/v{rm['registered_model']['version']}@")
    for key in ("heldout_true_score_base", "heldout_true_score_final", "heldout_rm_score_base", "heldout_rm_score_final"):
        assert isinstance(summary[key], float), key
    assert Path(summary["rm_vs_true_png"]).stat().st_size > 1000
    store = open_store()
    norms = []
    for k in (0, 1):
        rows = store.read_stage(stage_prefix("rlhf-e2e", k, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()
        assert len(rows) == 16 and {r["reward_status"] for r in rows} == {"ok"}
        assert {r["verifier"] for r in rows} == {"rm+exact"} and {r["verifier_version"] for r in rows} == {summary["reward_model_version"]}
        assert all("model 1×" in r["reward_reason"] and "normalised) + exact 0.5×" in r["reward_reason"] for r in rows)
        norms.append(store.read_manifest(stage_prefix("rlhf-e2e", k, "verify"))["meta"]["reward_norm"])
    assert norms[1]["count"] == norms[0]["count"] + 16  # the normaliser carries over from iteration to iteration
    progress = json.loads((settings().run_dir("rlhf-e2e") / "progress.json").read_text())
    assert progress["reward_norm"] == norms[1]
    run = Tracker(settings(), load_config(None, sets)).client.get_run(summary["mlflow_run_id"])
    for key in ("rm_score_mean", "true_reward_mean", "heldout_rm_score", "heldout_true_score", "validation_true_score",
                "alerts/reward_hacking", "vf_loss", "kl"):
        assert key in run.data.metrics, key


def test_reward_model_service_down_skips_samples(reward_model, tiny_checkpoint, monkeypatch):
    """The reward-model service passed the preflight, then died: samples are skipped, never scored 0."""
    from tests.helpers.gone import gone_after_preflight

    _, rm = reward_model
    monkeypatch.setenv("RLPIPE_REWARD_MODEL_URL", gone_after_preflight())
    sets = _rl_sets(tiny_checkpoint, rm["registered_model"]["version"], 1) + ["reward.weights={}", "reward.normalize=false"]
    summary = invoke(["run", "--run-id", "rlhf-rm-down"] + [x for s in sets for x in ("--set", s)])
    rows = open_store().read_stage(stage_prefix("rlhf-rm-down", 0, "verify"), schema=TRAJECTORY_SCHEMA).to_pylist()
    assert {r["reward_status"] for r in rows} == {"skipped"} and all(r["reward"] is None for r in rows)
    assert "unreachable" in rows[0]["reward_reason"]
    meta = open_store().read_manifest(stage_prefix("rlhf-rm-down", 0, "verify"))["meta"]
    assert any("reward-model service" in a for a in meta["alerts"])
    assert summary["heldout_rm_score_base"] is None  # nothing scored is reported as nothing, not 0
    assert summary["final_policy_version"] == file_weights_digest(tiny_checkpoint)


def test_a_resume_refuses_a_reward_model_that_changed():
    """`@best` moved to a newer reward model between a run's start and its resume: the reward would change
    mid-run, so the resume is refused unless the change is allowed."""
    from flows.train import _check_reward_model
    from rlpipe.progress import Progress
    from rlpipe.resume import ResumeRefused

    def started(version):  # what starting the services found: only the reward model's version matters here
        return SimpleNamespace(reward_model_version=version)

    progress = Progress(reward_model_version="rlpipe-x-rm/v1@aaaa")
    _check_reward_model("r", progress, started("rlpipe-x-rm/v1@aaaa"), False)  # same: fine
    with pytest.raises(ResumeRefused, match="v1@aaaa, which now resolves to rlpipe-x-rm/v2@bbbb"):
        _check_reward_model("r", progress, started("rlpipe-x-rm/v2@bbbb"), False)
    _check_reward_model("r", progress, started("rlpipe-x-rm/v2@bbbb"), True)  # allowed
    _check_reward_model("r", Progress(), started("rlpipe-x-rm/v2@bbbb"), False)  # a new run

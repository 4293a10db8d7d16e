"""The agent stages: episode task sets, episodes as trajectory rows, and the completeness check that
runs before training (a tampered or inconsistent episode becomes `error`, never trained on)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from rlpipe.config import DataConfig, load_config
from rlpipe.data.episodes import build_episode_tasks, episode_task, episode_task_findings
from rlpipe.envs import EnvLimits, EnvSpec
from rlpipe.envs.experts import demonstrate
from rlpipe.rollout.agent import check_episodes
from rlpipe.rollout.multiturn import encode_episode, episode_table
from rlpipe.storage.schemas import TRAJECTORY_SCHEMA
from rlpipe.training.tiny import build_char_tokenizer

SPEC = EnvSpec(env="calculator", limits=EnvLimits(max_steps=4))


def test_episode_task_sets_have_disjoint_seeded_splits():
    t = build_episode_tasks(SPEC, DataConfig(test_size=30, validation_size=10, train_size=100)).to_pylist()
    assert [sum(r["split"] == s for r in t) for s in ("test", "validation", "train")] == [30, 10, 100]
    keys = {s: {json.dumps(episode_task(r)[0], sort_keys=True) for r in t if r["split"] == s} for s in ("test", "validation", "train")}
    assert not keys["test"] & keys["train"] and not keys["validation"] & keys["train"] and not keys["test"] & keys["validation"]
    assert t == build_episode_tasks(SPEC, DataConfig(test_size=30, validation_size=10, train_size=100)).to_pylist()
    task, seed = episode_task(t[0])
    assert SPEC.make().reset(task, seed) == task["expression"]  # the row holds the task the environment runs


def test_a_small_task_family_is_refused_not_repeated():
    with pytest.raises(ValueError, match="fewer distinct tasks"):
        build_episode_tasks(EnvSpec(env="guess", params={"lo": 1, "hi": 5}), DataConfig(test_size=3, validation_size=0, train_size=5))


def test_rows_the_environment_refuses_are_named():
    t = build_episode_tasks(SPEC, DataConfig(test_size=2, validation_size=0, train_size=2)).to_pylist()
    t[1]["prompt"] = json.dumps({"task": {"expression": "1+"}, "seed": 0})
    t[2]["prompt"] = "not json"
    found = episode_task_findings(pa.Table.from_pylist(t), SPEC)
    assert len(found) == 2 and found[0].startswith("row 1") and "'expression'" in found[0] and found[1].startswith("row 2")


def _table(n: int = 3) -> pa.Table:
    tok = build_char_tokenizer()
    rollouts = [encode_episode(tok, demonstrate(SPEC, {}, s)) for s in range(n)]
    prompts = [{"id": f"p{s}"} for s in range(n)]
    return episode_table(rollouts, prompts, 1, tok, "run", 0, "sha", 1.0)


def test_episode_rows_carry_steps_mask_and_reward():
    rows = _table().to_pylist()
    r = rows[0]
    assert r["reward_status"] == "ok" and r["reward"] == 1.0 and r["verifier"] == "env:calculator"
    assert [s["action"][:5] for s in r["steps"]] == ["calc(", "answe"] and r["steps"][0]["observation"].startswith("=")
    assert json.loads(r["steps"][0]["info"]) == {"tool": "calc", "tool_error": False} and r["steps"][0]["env_s"] >= 0
    assert 0 in r["loss_mask"] and r["loss_mask"][0] == 1 and len(r["loss_mask"]) == len(r["response_token_ids"])
    checked, stats = check_episodes(_table(), max_steps=4)
    assert stats["episode/incomplete"] == 0 and all(x["reward_status"] == "ok" for x in checked.to_pylist())


@pytest.mark.parametrize("tamper, words", [
    (lambda r: r["steps"][0].update(observation=None), "no observation"),
    (lambda r: r["steps"].pop(), "not the sum"),
    (lambda r: r.update(reward=0.5), "not the sum"),
    (lambda r: r["loss_mask"].pop(), "mask entries"),
    (lambda r: r.update(steps=r["steps"] * 3), "more than max_steps=4"),
    (lambda r: r.update(steps=[]), "no steps"),
    (lambda r: r["steps"][1].update(reward=float("nan")), "not a finite number"),
])
def test_the_completeness_check_turns_a_broken_episode_into_an_error(tamper, words):
    rows = _table(2).to_pylist()
    tamper(rows[0])
    checked, stats = check_episodes(pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA), max_steps=4)
    bad, good = checked.to_pylist()
    assert bad["reward_status"] == "error" and bad["reward"] is None and words in bad["reward_reason"], bad["reward_reason"]
    assert good["reward_status"] == "ok" and stats["episode/incomplete"] == 1


def test_demo_recipe_is_a_valid_agent_config():
    from rlpipe.cli import AGENT_DEMO

    cfg = load_config(None, AGENT_DEMO)
    assert cfg.agent.spec().env == "calculator" and cfg.agent.spec().limits.max_steps == 4
    assert load_config(None, AGENT_DEMO + ["agent.max_steps=2"]).agent.spec().limits.max_steps == 2
    from_file = load_config(None, [x for x in AGENT_DEMO if not x.startswith("agent.env=")] + ["agent.env=configs/envs/calculator.yaml"])
    assert from_file.agent.spec() == cfg.agent.spec()

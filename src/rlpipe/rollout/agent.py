"""An RL iteration's agent stages: episodes of prompt rows as trajectory tables, their completeness
check before training, and greedy evaluation — what the iteration's tasks call when a run has ``agent:``.

Where environment steps run: in-process (``agent.executor: local``, the embedded default), each call in
its own sandbox on this machine (``sandbox``), or the environment service at ``RLPIPE_ENV_URL``
(``rlpipe serve env``), which wins when set.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from rlpipe.data.episodes import episode_task
from rlpipe.envs.base import Environment
from rlpipe.envs.episode import completeness_problems
from rlpipe.envs.metrics import episode_metrics
from rlpipe.rollout.base import RolloutEngine, SamplingConfig
from rlpipe.rollout.multiturn import episode_table, run_episodes
from rlpipe.storage.schemas import TRAJECTORY_SCHEMA


def env_factory(agent: Any, env_url: str | None = None) -> Callable[[], Environment]:
    """A builder of one episode's environment, as the run's ``agent`` section and ``RLPIPE_ENV_URL`` say."""
    spec = agent.spec()
    if env_url:
        from rlpipe.envs.sandboxed import remote_env

        return lambda: remote_env(spec, env_url, timeout_s=agent.step_timeout_s * (spec.limits.max_steps + 1) + 30)
    if agent.executor == "sandbox":
        from rlpipe.envs.sandboxed import SandboxOptions, sandboxed_env

        opts = SandboxOptions(step_timeout_s=agent.step_timeout_s, allow_hosts=tuple(agent.allow_hosts))
        return lambda: sandboxed_env(spec, opts)
    return spec.make


def _episodes(engine: RolloutEngine, tokenizer: Any, agent: Any, rows: list[dict[str, Any]], n: int,
              sampling: SamplingConfig, env_url: str | None):
    tasks = [episode_task(r) for r in rows for _ in range(n)]
    return run_episodes(engine, tokenizer, agent.spec(), tasks, sampling, chat=agent.chat, max_context=agent.max_context,
                        system=agent.system, make_env=env_factory(agent, env_url),
                        step_workers=agent.step_workers if (env_url or agent.executor != "local") else 1)


def agent_rollout(engine: RolloutEngine, tokenizer: Any, agent: Any, prompts: list[dict[str, Any]], sampling: SamplingConfig,
                  run_id: str, iteration: int, env_url: str | None = None) -> tuple[pa.Table, dict[str, float]]:
    """``sampling.n`` episodes per prompt row as a trajectory table, with the episode metrics."""
    start = time.perf_counter()
    rollouts = _episodes(engine, tokenizer, agent, prompts, sampling.n, SamplingConfig(
        n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens, seed=sampling.seed),
        env_url)
    gen_s = time.perf_counter() - start
    table = episode_table(rollouts, prompts, sampling.n, tokenizer, run_id, iteration, engine.weights_sha256(), gen_s)
    policy = sum(sum(r.loss_mask) for r in rollouts)
    stats = episode_metrics([r.episode for r in rollouts]) | {
        "generate_s": gen_s, "response_tokens": policy, "generate_tokens_per_s": policy / max(gen_s, 1e-9),
        "episode/observation_token_share": 1 - policy / max(sum(len(r.loss_mask) for r in rollouts), 1)}
    return table, stats


def check_episodes(table: pa.Table, max_steps: int) -> tuple[pa.Table, dict[str, float]]:
    """The completeness check, before training: every ``ok`` episode's actions, observations and rewards
    line up, it ended by ``done`` or its limit, its reward is the sum of its steps', and its loss mask
    covers its tokens. An episode that fails it becomes ``error`` (reason kept), never trained on."""
    rows, bad = table.to_pylist(), 0
    for r in rows:
        if r["reward_status"] != "ok":
            continue
        steps = r["steps"] or []
        done = not r["truncated"]  # an ok episode the limits did not cut was ended by its environment
        problems = completeness_problems(steps, done=done, truncated=bool(r["truncated"]), max_steps=max_steps)
        if len(r["loss_mask"] or []) != len(r["response_token_ids"]) or len(r["logprobs"] or []) != len(r["response_token_ids"]):
            problems.append(f"{len(r['response_token_ids'])} response tokens, {len(r['loss_mask'] or [])} mask entries, "
                            f"{len(r['logprobs'] or [])} log-probs")
        if r["reward"] is not None and abs(r["reward"] - sum(s["reward"] or 0.0 for s in steps)) > 1e-9:
            problems.append(f"reward {r['reward']} is not the sum of the step rewards")
        if problems:
            bad += 1
            r.update(reward=None, reward_status="error", reward_reason="incomplete episode: " + "; ".join(problems))
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA), {"episode/incomplete": float(bad)}


def agent_evaluate(engine: RolloutEngine, tokenizer: Any, agent: Any, rows: list[dict[str, Any]], max_new_tokens: int,
                   env_url: str | None = None) -> dict[str, Any]:
    """Greedy episodes on ``rows``: ``accuracy`` is the episode success share; steps and tool calls beside it."""
    out = _episodes(engine, tokenizer, agent, rows, 1, SamplingConfig(n=1, temperature=0.0, max_new_tokens=max_new_tokens),
                    env_url)
    m = episode_metrics([r.episode for r in out])
    return {"accuracy": m["episode/success_share"], "true_score": m["episode/reward_mean"], "rm_score": None, "n": len(rows),
            "mean_steps": m["episode/steps_mean"], "tool_calls_per_episode": m["episode/tool_calls_per_episode"],
            "error_share": m["episode/error_share"], "truncated_share": m["episode/truncated_share"],
            "sample": json.dumps(out[0].episode.record()[:4]) if out else None,
            "samples": [_sample(r, o.episode) for r, o in list(zip(rows, out))[:8]]}


def _sample(row: dict[str, Any], episode: Any) -> dict[str, Any]:
    """One evaluated episode as a table row: the task, the turns, the verdict."""
    turns = " | ".join(f"{s['action']} → {s['observation']}" for s in episode.record())
    return {"prompt": row["prompt"], "response": turns, "ground_truth": None, "status": episode.status,
            "reward": episode.reward if episode.status == "ok" else None}

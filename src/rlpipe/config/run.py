"""The whole run config (:class:`RunConfig`): its sections, the checks across them, and its fingerprint."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import Field, model_validator

from rlpipe.config.agent import AgentConfig
from rlpipe.config.alerts import AlertsConfig
from rlpipe.config.infra import RetentionConfig, ServicesConfig, StorageConfig, TrackingConfig
from rlpipe.config.reward import RewardConfig
from rlpipe.config.rollout import RolloutConfig
from rlpipe.config.supervised import RewardModelConfig, SFTConfig
from rlpipe.config.task import DataConfig, ModelConfig, TaskConfig
from rlpipe.config.train import TOKEN_LEVEL_ADVANTAGES, TrainConfig
from rlpipe.yamlio import Strict


class RunConfig(Strict):
    """Everything that defines a run. Its fingerprint identifies the experiment."""

    task: TaskConfig = Field(default_factory=TaskConfig, description="What is trained, on what.")
    data: DataConfig = Field(default_factory=DataConfig, description="The synthetic dataset (builtin tasks).")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Shape of the tiny base model.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised warm-up.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Where rewards come from.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling of completions.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The RL update.")
    rm: RewardModelConfig = Field(default_factory=RewardModelConfig, description="Reward-model training (RLHF).")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Object store for runs.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    agent: AgentConfig | None = Field(None, description="Multi-step agentic RL in an environment; null: single-turn.")
    alerts: AlertsConfig = Field(default_factory=AlertsConfig, description="Alert rules on a run's metrics.")
    retention: RetentionConfig = Field(default_factory=RetentionConfig, description="What `rlpipe gc` keeps.")
    services: ServicesConfig = Field(default_factory=ServicesConfig, description="Where the run's services run "
                                     "(default: in this process).")
    seed: int = Field(0, description="Seed for model init, sampling and data order.")

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        if self.agent is not None:
            if self.reward.type != "rule_based" or self.reward.weights:
                raise ValueError("@reward.type@an agent run's reward is its environment's (the episode reward); "
                                 "remove reward.type/reward.weights")
            if self.task.dataset != "builtin:episodes":
                raise ValueError("@task.dataset@an agent run draws its tasks from the environment: use builtin:episodes")
            if self.rollout.dynamic_sampling:
                raise ValueError("@rollout.dynamic_sampling@not supported with agent: yet; set it to false")
            if self.sft.nproc > 1:  # its validation runs episodes on the caller's engine, not on a rank
                raise ValueError("@sft.nproc@agent SFT on expert traces runs in one process; set sft.nproc: 1")
            if self.agent.step_rewards and self.train.resolved()["advantage"] not in TOKEN_LEVEL_ADVANTAGES:
                raise ValueError(f"@agent.step_rewards@the {self.train.resolved()['advantage']!r} estimator sees only the episode's "
                                 f"total reward; per-step credit needs one of {', '.join(sorted(TOKEN_LEVEL_ADVANTAGES))} "
                                 "(train.algorithm: ppo, or train.advantage)")
        if self.rollout.temperature == 0:
            raise ValueError("@rollout.temperature@0 (greedy) cannot train with RL: a greedy sample has no "
                             "log-probability under the policy the trainer differentiates; use a temperature > 0 "
                             "(1.0 is the usual)")
        if self.rollout.top_p < 1:
            raise ValueError(f"@rollout.top_p@{self.rollout.top_p} truncates the sampler's distribution, which the "
                             "trainer's log-probs do not reproduce (the importance ratio would be wrong); use 1.0")
        buf = self.reward.overlong_buffer
        if buf is not None and buf >= self.rollout.max_new_tokens:
            raise ValueError(
                f"reward.overlong_buffer ({buf}) must be below rollout.max_new_tokens ({self.rollout.max_new_tokens})"
            )
        return self

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of this config (defaults filled in), without ``services``: where a
        run's services run is not the experiment."""
        return hashlib.sha256(canonical_json(self.model_dump(mode="json", exclude={"services"})).encode()).hexdigest()

    def flat(self) -> dict[str, Any]:
        """Dotted keys → values, for MLflow params."""
        return _flatten(self.model_dump(mode="json"))

    @property
    def registered_model(self) -> str:
        return self.tracking.registered_model or f"rlpipe-{self.task.name}"

    @property
    def registered_reward_model(self) -> str:
        return self.rm.registered_model or f"rlpipe-{self.task.name}-rm"

    @property
    def reward_model_spec(self) -> str:
        return self.reward.model or f"models:/{self.registered_reward_model}@best"


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out

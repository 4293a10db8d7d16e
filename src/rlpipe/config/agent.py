"""The run config's ``agent:`` section: multi-step agentic RL in an environment (the spec, its limits, where its
steps run, the SFT warm-up on expert demonstrations)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from rlpipe.envs.spec import EnvSpec, env_class, tool_free_envs
from rlpipe.yamlio import Strict, read_yaml


def _check_tool_share(share: float, spec: EnvSpec) -> None:
    if share < 1 and not env_class(spec.env).tool_free:
        raise ValueError(f"@sft_tool_share@the {spec.env!r} expert cannot solve its tasks without the tool; "
                         f"set 1 (environments whose expert can: {', '.join(tool_free_envs())})")


class AgentConfig(Strict):
    """Multi-step agentic RL: the policy acts in an environment over several turns (see ``rlpipe.envs``)."""

    env: Any = Field(description="The environment: a path to its spec YAML (configs/envs/*.yaml) or the spec inline "
                     "({env, params, limits, tools}).")
    max_steps: int | None = Field(None, ge=1, le=1000, description="Override of the spec's limits.max_steps.")
    episode_timeout_s: float | None = Field(None, gt=0, description="Override of the spec's limits.episode_timeout_s.")
    executor: Literal["local", "sandbox"] = Field(
        "local", description="Where environment steps run: local (in-process pool), or sandbox (each call in its own "
        "sandbox on this machine). The environment service is not read from here: set RLPIPE_ENV_URL.")
    step_timeout_s: float = Field(10.0, gt=0, description="sandbox/service: seconds one step may take; past it the episode is an error.")
    allow_hosts: list[str] = Field(default_factory=list, description="executor sandbox: 'host:port' pairs the environment may "
                                   "reach (through rlpipe.envs.net.connect and an allow-list proxy); empty: no network.")
    step_workers: int = Field(8, ge=1, le=256, description="sandbox/service: environment steps run at once within a turn.")
    max_context: int = Field(256, ge=16, description="Tokens of an episode's whole context (prompt, actions, observations); "
                             "an episode that would outgrow it is cut and flagged truncated.")
    chat: bool = Field(True, description="Turns through the model's chat template (observations as tool messages).")
    system: str | None = Field(None, description="A system message before the first observation.")
    step_rewards: bool = Field(False, description="Credit each step's reward at its own action (token-level estimators: gae, "
                               "reinforce_pp*); false: the episode's total reward at its end (outcome).")
    sft_traces: int = Field(2000, ge=1, description="SFT warm-up: expert demonstrations drawn from the training tasks.")
    sft_tool_share: float = Field(1.0, gt=0, le=1, description="SFT warm-up: the share of demonstrations in which the "
                                  "expert calls the tool; in the others it answers at once, in its head (calculator "
                                  "only). Below 1 the base calls the tool only sometimes, and RL learns when it pays.")

    @model_validator(mode="before")
    @classmethod
    def _read_env(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("env"), str):
            path = Path(data["env"])
            data = dict(data, env=read_yaml(path))
            try:
                EnvSpec.model_validate(data["env"])
            except ValidationError as e:  # report the problem in the spec's own file
                raise ValueError(f"@env@{path}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        return data

    @model_validator(mode="after")
    def _spec(self) -> "AgentConfig":
        if self.allow_hosts and self.executor != "sandbox":
            raise ValueError("@allow_hosts@only a sandboxed environment has an allow-list (in-process environments are "
                             "trusted and unrestricted); set executor: sandbox, or give the service --allow-host")
        bad = [h for h in self.allow_hosts if not h.rpartition(":")[2].isdigit() or not h.rpartition(":")[0]]
        if bad:
            raise ValueError(f"@allow_hosts@{bad}: give each as host:port")

        if isinstance(self.env, EnvSpec):
            _check_tool_share(self.sft_tool_share, self.env)
            return self
        try:
            spec = EnvSpec.model_validate(self.env)
        except ValidationError as e:
            first = e.errors()[0]
            loc, msg = ".".join(map(str, first["loc"])), first["msg"].removeprefix("Value error, ")
            if msg.startswith("@"):  # the spec's own validator naming its key
                key, msg = msg[1:].split("@", 1)
                loc = f"{loc}.{key}" if loc else key
            raise ValueError(f"@env.{loc}@{msg}") from None
        _check_tool_share(self.sft_tool_share, spec)
        self.env = spec  # validate_assignment runs these checks again, on the spec
        return self

    def spec(self):
        """The environment spec with this section's limit overrides applied."""
        limits = self.env.limits.model_copy(update={k: v for k, v in (("max_steps", self.max_steps),
                                                                      ("episode_timeout_s", self.episode_timeout_s)) if v is not None})
        return self.env.model_copy(update={"limits": limits})

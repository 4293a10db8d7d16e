"""The run config's ``reward:`` section: where rewards come from (verifiers, a reward model, a mix), the verifier
pool's limits, the sandbox level that code verdicts need, and the circuit breaker on unscored samples."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlpipe.yamlio import Strict


SANDBOX_COMPONENTS = ("bwrap", "seccomp", "uid", "rlimits", "cgroup")


# Keys that name features rlpipe does not have yet. They are refused with this message rather than
# accepted and ignored (a config key nothing implements is an error, not a silent no-op).
_NOT_IMPLEMENTED = {
    "reward.type=model_based": "the reward-model type is called 'model': use type: model (and reward.model)",
    "reward.endpoint": "the verifier service is not read from the config: remove this key and set "
    "RLPIPE_VERIFIER_URL=<url>",
    "reward.timeout_s": "removed: each sample's hard deadline is its verifier's declared budget plus "
    "reward.grace_s; remove this key (or set reward.grace_s)",
}


class RewardConfig(Strict):
    type: Literal["rule_based", "model"] = Field(
        "rule_based", description="rule_based: verifiers score answers; model: a reward model scores them (RLHF; "
        "in-process, or the service at RLPIPE_REWARD_MODEL_URL)."
    )
    model: str | None = Field(
        None, description="type model: the reward model (a folder or 'models:/NAME@ALIAS'); default: "
        "models:/rlpipe-<task.name>-rm@best."
    )
    weights: dict[str, float] = Field(
        default_factory=dict, description="Mix several reward sources: {'model': w, '<verifier>': w, ...} — the reward "
        "is the weighted sum; a sample is scored only when every source judged it. Empty: the type's one source "
        "(the reward model, or each row's own verifier)."
    )
    normalize: bool = Field(
        False, description="type model: standardise the reward model's score with a running mean/std (seeded with "
        "the statistics registered with the model), then clip to ±clip (PPO-RLHF style)."
    )
    clip: float | None = Field(5.0, gt=0, description="Clip of the normalised reward-model score (normalize only).")
    hacking_window: int = Field(
        3, ge=2, description="Reward-hacking alert: fires when, over this many held-out evaluations, the reward "
        "model's score rose while the task's true score (its verifier's) fell."
    )
    verifier: str = Field("math", description="Verifier for prompt rows that name none (e.g. math, code, format).")
    workers: int = Field(2, ge=1, le=64, description="Verifier worker processes (bounded concurrency).")
    grace_s: float = Field(
        5.0, gt=0, description="Added to each verifier's declared budget for a sample to get the pool's hard "
        "wall-clock deadline (a worker past it is killed and the sample gets status 'timeout'). The budget "
        "itself comes from the verifier, so the pool never pre-empts a verdict the verifier would give."
    )
    plugins: list[str] = Field(default_factory=list, description="Python modules imported in verifier workers to register extra verifiers.")
    code_scoring: Literal["fraction", "all"] = Field(
        "fraction", description="Code verifier: 'fraction' rewards the share of tests passed; 'all' gives 1 only "
        "when every test passes, else 0."
    )
    sandbox_min_level: str = Field(
        "full", description="Least sandbox isolation a run that executes model code may score at: 'full' (all of "
        "bwrap+seccomp+uid+rlimits+cgroup) or the '+'-joined components required, e.g. 'seccomp+rlimits'. "
        "The run refuses to start below it; the level used is stored on every trajectory row."
    )
    max_invalid_share: float = Field(
        0.5, ge=0, le=1, description="Circuit breaker: an iteration whose share of samples not 'ok' is above this "
        "counts as invalid."
    )
    max_invalid_iterations: int = Field(
        3, ge=1, description="Circuit breaker: stop the run (resumably) after this many invalid iterations in a row."
    )
    overlong_buffer: int | None = Field(
        None, ge=1, description="DAPO soft overlong punishment: responses longer than max_new_tokens − buffer lose "
        "up to overlong_penalty linearly (null: off)."
    )
    overlong_penalty: float = Field(1.0, ge=0, description="Largest overlong punishment (reached at max_new_tokens).")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("type") == "model_based":
                raise ValueError(f"@type@{_NOT_IMPLEMENTED['reward.type=model_based']}")
            for key in ("endpoint", "timeout_s"):
                if key in data:
                    raise ValueError(f"@{key}@{_NOT_IMPLEMENTED['reward.' + key]}")
        return data

    @field_validator("sandbox_min_level")
    @classmethod
    def _known_components(cls, v: str) -> str:
        if v == "full":
            return v
        parts = v.split("+")
        bad = [p for p in parts if p not in SANDBOX_COMPONENTS]
        if bad or not v:
            raise ValueError(f"unknown sandbox component(s) {bad or [v]}; use 'full' or a '+'-joined subset of "
                             f"{'+'.join(SANDBOX_COMPONENTS)}")
        return v

    @model_validator(mode="after")
    def _sources(self) -> "RewardConfig":
        if self.type == "rule_based" and "model" in self.weights:
            raise ValueError("@weights@names 'model' but reward.type is rule_based; set type: model")
        if self.type == "model" and self.weights and "model" not in self.weights:
            raise ValueError("@weights@type model needs a 'model' weight, e.g. {model: 1.0, format: 0.2}")
        if self.normalize and self.type != "model":
            raise ValueError("@normalize@normalises the reward model's score; it needs type: model")
        return self

    def source_weights(self) -> dict[str, float]:
        """Reward source → weight; 'model' is the reward model, any other name a verifier, '' each row's own."""
        if self.weights:
            return dict(self.weights)
        return {"model": 1.0} if self.type == "model" else {"": 1.0}

    def required_sandbox_components(self) -> tuple[str, ...]:
        if self.sandbox_min_level == "full":
            return SANDBOX_COMPONENTS
        return tuple(c for c in SANDBOX_COMPONENTS if c in self.sandbox_min_level.split("+"))

    def verifier_options(self) -> dict[str, dict[str, Any]]:
        """Per-verifier options the pool passes to each call."""
        return {"code": {"scoring": self.code_scoring}}

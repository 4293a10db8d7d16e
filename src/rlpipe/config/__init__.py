"""The run config: pydantic models loaded from YAML, validated strictly, fingerprinted.

A run config says *what* to train. *Where* things live (endpoints, credentials) comes from
``RLPIPE_*`` environment variables (see :class:`Settings`), never from the YAML: a config file
is shared, committed and logged to MLflow, so it must not carry secrets or one machine's hosts.

    cfg = load_config("configs/demo.yaml", overrides=["sft.steps=300"])
    cfg.fingerprint()  # sha256 of the canonical JSON of the validated config

The package, by idea:

- :mod:`.loader`: the YAML file, ``--set`` overrides, validation (:func:`load_config`).
- :mod:`.run`: :class:`RunConfig`, the checks across its sections, the fingerprint.
- the sections: :mod:`.task` (task, data, model), :mod:`.supervised` (sft, rm), :mod:`.reward`, :mod:`.rollout`,
  :mod:`.train`, :mod:`.agent`, :mod:`.infra` (storage, tracking, services, retention), :mod:`.alerts`.
- :mod:`.settings`: :class:`Settings`, read from ``RLPIPE_*`` variables by :func:`settings`.

YAML reading and validation by YAML path are :mod:`rlpipe.yamlio`'s, shared with environment specs and eval
suites. Every name here is importable from ``rlpipe.config``.
"""

from rlpipe.config.agent import AgentConfig
from rlpipe.config.alerts import AlertsConfig
from rlpipe.config.infra import RetentionConfig, ServicesConfig, StorageConfig, TrackingConfig
from rlpipe.config.loader import apply_overrides, load_config, validate_raw
from rlpipe.config.reward import SANDBOX_COMPONENTS, RewardConfig
from rlpipe.config.rollout import RolloutConfig
from rlpipe.config.run import RunConfig, canonical_json
from rlpipe.config.settings import Settings, settings
from rlpipe.config.supervised import RewardModelConfig, SFTConfig
from rlpipe.config.task import DataConfig, ModelConfig, TaskConfig
from rlpipe.config.train import TOKEN_LEVEL_ADVANTAGES, CriticConfig, LoraConfig, TrainConfig
from rlpipe.yamlio import ConfigError, read_yaml, validate_model

__all__ = [
    "SANDBOX_COMPONENTS", "TOKEN_LEVEL_ADVANTAGES", "AgentConfig", "AlertsConfig", "ConfigError", "CriticConfig", "DataConfig",
    "LoraConfig", "ModelConfig", "RetentionConfig", "RewardConfig", "RewardModelConfig", "RolloutConfig", "RunConfig",
    "SFTConfig", "ServicesConfig", "Settings", "StorageConfig", "TaskConfig", "TrackingConfig", "TrainConfig",
    "apply_overrides", "canonical_json", "load_config", "read_yaml", "settings", "validate_model", "validate_raw",
]

"""Run config sections for where a run keeps things: the object store, MLflow tracking, the services' URLs and
what ``rlpipe gc`` keeps. Endpoints that belong to a machine, and every credential, come from ``RLPIPE_*``
variables (:mod:`rlpipe.config.settings`), never from the file."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from rlpipe.yamlio import Strict


def _reject_network_endpoint(value: str | None, env_var: str) -> str | None:
    if value and "://" in value and value.split("://", 1)[0] in ("http", "https", "grpc"):
        raise ValueError(
            f"network endpoints are not read from the config file; remove this key and set {env_var}={value} instead"
        )
    return value


class StorageConfig(Strict):
    uri: str | None = Field(
        None,
        description="Where runs are stored: a local folder or 's3://bucket/prefix'. Default: "
        "$RLPIPE_STORAGE_URI, else $RLPIPE_HOME/store. The S3 endpoint and keys come from RLPIPE_S3_*.",
    )

    @field_validator("uri")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        if v and "@" in urlsplit(v).netloc:
            raise ValueError("credentials in the storage URI; set RLPIPE_S3_ACCESS_KEY_ID/SECRET_ACCESS_KEY instead")
        return _reject_network_endpoint(v, "RLPIPE_S3_ENDPOINT_URL")


class TrackingConfig(Strict):
    uri: str | None = Field(
        None,
        description="MLflow tracking URI; set RLPIPE_TRACKING_URI for a server. Default: a sqlite file in $RLPIPE_HOME.",
    )
    experiment: str = Field("rlpipe", description="MLflow experiment the runs are logged to.")
    registered_model: str | None = Field(
        None, description="Registry name for checkpoints; default: 'rlpipe-<task.name>'."
    )
    register_models: bool = Field(
        True, description="Register checkpoints as model versions (each with an rlpipe.checkpoint.registered event). "
        "false: a smoke or debug run registers nothing and moves no alias; its checkpoints stay in the store and "
        "it still resumes.")
    stage_task_runs: bool = Field(
        False, description="Record each stage of an iteration (rollout, verify, update, sync-weights, "
        "upload-checkpoint) as a Prefect task run of the iteration's flow run, for a box per stage in the UI. "
        "Each task run adds the Prefect server's work of storing its events. false: the stages run as calls; "
        "their retries, timeouts and log lines are the same, the stage times are in the run's metrics (time/*) "
        "and in each iteration's log line. register-checkpoint, at save points, is a task run either way.")
    system_metrics_s: float | None = Field(
        10.0, gt=0, description="MLflow system metrics (system/cpu_utilization_percentage, memory, disk, network, "
        "GPU) sampled every this many seconds while an RL run trains; null: off.")

    @field_validator("uri")
    @classmethod
    def _uri_from_env(cls, v: str | None) -> str | None:
        return _reject_network_endpoint(v, "RLPIPE_TRACKING_URI")


class ServicesConfig(Strict):
    """Where a run's services run. Unset: in this process (a local verifier pool, an in-process engine and
    trainer). Each ``RLPIPE_<SERVICE>_URL`` variable overrides its key on a machine; tokens come only from
    the environment (``RLPIPE_<SERVICE>_TOKEN``), never from a config."""

    rollout: list[str] = Field(default_factory=list, description="Rollout service replicas (rlpipe serve rollout): prompts "
                               "are split across them and a dead one's share goes to the others. Env: RLPIPE_ROLLOUT_URL.")
    trainer: str | None = Field(None, description="The trainer service (rlpipe serve trainer). Env: RLPIPE_TRAINER_URL.")
    verifier: str | None = Field(None, description="The verifier service (rlpipe serve verifier). Env: RLPIPE_VERIFIER_URL.")
    reward_model: str | None = Field(None, description="The reward-model service (rlpipe serve reward-model). "
                                     "Env: RLPIPE_REWARD_MODEL_URL.")
    env: str | None = Field(None, description="The environment service of agent runs (rlpipe serve env). Env: RLPIPE_ENV_URL.")

    @field_validator("rollout", "trainer", "verifier", "reward_model", "env")
    @classmethod
    def _http(cls, v: Any) -> Any:
        for url in (v if isinstance(v, list) else [v]):
            if url is not None and not str(url).startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not a service URL: give http(s)://HOST:PORT")
        return v


class RetentionConfig(Strict):
    """What ``rlpipe gc`` keeps in the object store and the registry. It never deletes a checkpoint a registry
    alias points to (best, latest, base, …), a run's resume point, a model version a run's config names, or
    the trajectories of an iteration a run has not finished."""

    keep_checkpoints: int | None = Field(None, ge=1, description="Per run, keep the newest this many checkpoints "
                                         "(beside the protected ones); the rest and their registry versions go. "
                                         "null: keep all.")
    trajectory_days: float | None = Field(None, ge=0, description="Delete a finished iteration's trajectory stages "
                                          "(rollout, verify Parquet) this many days after they were written. "
                                          "null: keep them.")

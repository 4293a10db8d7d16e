"""Where things live on this machine (:class:`Settings`), read from ``RLPIPE_*`` environment variables when asked
(:func:`settings`), never at import time and never from a config file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from rlpipe.config.run import RunConfig


class Settings(BaseModel):
    """Where things live on this machine; read from ``RLPIPE_*`` environment variables."""

    home: Path = Field(description="RLPIPE_HOME: project state (runs, store, MLflow); default ./.rlpipe")
    storage_uri: str | None = Field(None, description="RLPIPE_STORAGE_URI: overrides storage.uri")
    tracking_uri: str | None = Field(None, description="RLPIPE_TRACKING_URI: an MLflow server or sqlite URI")
    s3_endpoint_url: str | None = Field(None, description="RLPIPE_S3_ENDPOINT_URL: S3-compatible endpoint")
    s3_access_key_id: str | None = Field(None, description="RLPIPE_S3_ACCESS_KEY_ID (else AWS_ACCESS_KEY_ID)")
    s3_secret_access_key: str | None = Field(
        None, description="RLPIPE_S3_SECRET_ACCESS_KEY (else AWS_SECRET_ACCESS_KEY)", repr=False
    )
    s3_session_token: str | None = Field(
        None, description="RLPIPE_S3_SESSION_TOKEN (else AWS_SESSION_TOKEN, with AWS_* keys): temporary credentials",
        repr=False)
    s3_key_source: str | None = Field(
        None, description="where the keys came from: 'RLPIPE_S3_' or 'AWS_' (the prefix of their variables)")
    s3_region: str | None = Field(None, description="RLPIPE_S3_REGION (else AWS_DEFAULT_REGION)")
    verifier_url: str | None = Field(None, description="RLPIPE_VERIFIER_URL: score through the verifier service")
    env_url: str | None = Field(None, description="RLPIPE_ENV_URL: agent runs step their environments through this service")
    reward_model_url: str | None = Field(
        None, description="RLPIPE_REWARD_MODEL_URL: score with the reward-model service instead of in-process")
    rollout_urls: tuple[str, ...] = Field(
        (), description="RLPIPE_ROLLOUT_URL: rollout service replicas (comma-separated) instead of an in-process engine")
    trainer_url: str | None = Field(None, description="RLPIPE_TRAINER_URL: update through the trainer service")
    pushgateway_url: str | None = Field(
        None, description="RLPIPE_PUSHGATEWAY_URL: push each iteration's metrics to this Prometheus Pushgateway")

    def for_run(self, cfg: RunConfig) -> "Settings":
        """These settings with the service URLs the config names where no RLPIPE_*_URL variable set one."""
        sv = cfg.services
        return self.model_copy(update={
            "rollout_urls": self.rollout_urls or tuple(sv.rollout), "trainer_url": self.trainer_url or sv.trainer,
            "verifier_url": self.verifier_url or sv.verifier, "reward_model_url": self.reward_model_url or sv.reward_model,
            "env_url": self.env_url or sv.env})

    def resolve_storage_uri(self, cfg: RunConfig | None = None) -> str:
        if self.storage_uri:
            return self.storage_uri
        if cfg is not None and cfg.storage.uri:
            return cfg.storage.uri
        return str((self.home / "store").resolve())

    def resolve_tracking_uri(self, cfg: RunConfig | None = None) -> str:
        if self.tracking_uri:
            return self.tracking_uri
        if cfg is not None and cfg.tracking.uri:
            return cfg.tracking.uri
        return f"sqlite:///{(self.home / 'mlflow.db').resolve()}"

    @property
    def artifact_root(self) -> Path:
        return (self.home / "mlartifacts").resolve()

    def run_dir(self, run_id: str) -> Path:
        return (self.home / "runs" / run_id).resolve()


def settings(environ: dict[str, str] | None = None) -> Settings:
    """Read settings from the environment now (never at import time)."""
    env = os.environ if environ is None else environ
    return Settings(
        home=Path(env.get("RLPIPE_HOME", ".rlpipe")),
        storage_uri=env.get("RLPIPE_STORAGE_URI") or None,
        tracking_uri=env.get("RLPIPE_TRACKING_URI") or None,
        s3_endpoint_url=env.get("RLPIPE_S3_ENDPOINT_URL") or None,
        **_s3_keys(env),
        s3_region=env.get("RLPIPE_S3_REGION") or env.get("AWS_DEFAULT_REGION") or None,
        verifier_url=env.get("RLPIPE_VERIFIER_URL") or None,
        env_url=env.get("RLPIPE_ENV_URL") or None,
        reward_model_url=env.get("RLPIPE_REWARD_MODEL_URL") or None,
        rollout_urls=tuple(u.strip() for u in env.get("RLPIPE_ROLLOUT_URL", "").split(",") if u.strip()),
        trainer_url=env.get("RLPIPE_TRAINER_URL") or None,
        pushgateway_url=env.get("RLPIPE_PUSHGATEWAY_URL") or None,
    )


def _s3_keys(env) -> dict[str, str | None]:
    """The S3 key id, secret and session token from one source, never mixed: RLPIPE_S3_* if either key is set
    there, else AWS_*. A token belongs to the key id it was issued with, so a shell's AWS_SESSION_TOKEN never
    rides along with RLPIPE_S3_* keys meant for another endpoint. None of them: botocore's default chain."""
    for prefix in ("RLPIPE_S3_", "AWS_"):
        key, secret = env.get(f"{prefix}ACCESS_KEY_ID") or None, env.get(f"{prefix}SECRET_ACCESS_KEY") or None
        if key or secret:
            return {"s3_access_key_id": key, "s3_secret_access_key": secret,
                    "s3_session_token": env.get(f"{prefix}SESSION_TOKEN") or None, "s3_key_source": prefix}
    return {}

"""A run's context, resolved once: the settings for the run, its object store, its run folder, the two
fingerprints of its config, the local paths of the models it names, its tracker and its metrics pusher.

The train flow builds it at the start and registers it under the run id; the tasks of every iteration
ask for it (:func:`run_context`) instead of rebuilding each piece per call. The config it holds is the
config as given — never rewritten: a ``models:/NAME@ALIAS`` reference stays that, and its local copy is in
:attr:`RunContext.models`. A resume compares the config as given, so a recorded cache path could never
match again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from rlpipe.config import RunConfig, Settings, settings
from rlpipe.resume import RunState, resume_fingerprint
from rlpipe.runs import RunFolder
from rlpipe.storage.store import ObjectStore, open_store

if TYPE_CHECKING:
    from rlpipe.tracking.mlflow_utils import Tracker
    from rlpipe.tracking.prom_push import MetricsPusher

__all__ = ["ModelPaths", "RunContext", "find_context", "forget_context", "register_context", "run_context"]


@dataclass(frozen=True)
class ModelPaths:
    """Local folders of the models a run names (``models:/`` and ``s3://`` references fetched once)."""

    policy: str
    ref: str | None = None
    critic: str | None = None


@dataclass
class RunContext:
    run_id: str
    config: RunConfig  # as given: what the run records and a resume compares
    settings: Settings  # with the service URLs the config names (an RLPIPE_*_URL variable overrides its key)
    store: ObjectStore
    folder: RunFolder
    fingerprint: str  # config.fingerprint(): the whole config
    resume_fingerprint: str  # what stored stages must match to be reused
    models: ModelPaths | None = field(default=None)  # set by resolve_models, once the data is ready
    # A resume from a save point before the last completed iteration: the iterations up to this one are redone,
    # and their metrics are in MLflow already (logged once, not twice); the parent's outer timings up to the other.
    logged_through: int = -1
    outer_logged_through: int = -1

    @classmethod
    def resolve(cls, config: RunConfig, run_id: str, s: Settings | None = None) -> "RunContext":
        s = (s or settings()).for_run(config)
        return cls(run_id=run_id, config=config, settings=s, store=open_store(s.resolve_storage_uri(config), s),
                   folder=RunFolder(s.run_dir(run_id)), fingerprint=config.fingerprint(),
                   resume_fingerprint=resume_fingerprint(config))

    @cached_property
    def state(self) -> RunState:
        """The run's progress and resumable state, here and in the store."""
        return RunState(self.store, self.folder, self.run_id)

    @cached_property
    def tracker(self) -> "Tracker":
        from rlpipe.tracking.mlflow_utils import Tracker

        return Tracker(self.settings, self.config)

    @cached_property
    def pusher(self) -> "MetricsPusher | None":
        """Where each iteration's metrics are pushed for Prometheus (RLPIPE_PUSHGATEWAY_URL), or None: one per run,
        so that its back-off after a failed push outlives the iteration."""
        from rlpipe.tracking.prom_push import metrics_pusher

        return metrics_pusher(self.settings.pushgateway_url, self.run_id, self.config.tracking.experiment)

    def resolve_models(self) -> ModelPaths:
        """The policy, reference and critic models as local folders (fetched once per run)."""
        if self.models is None:
            c = self.config
            self.models = ModelPaths(policy=self._local(c.task.policy_model), ref=self._local(c.task.ref_model),
                                     critic=self._local(c.train.critic.model))
        return self.models

    def _local(self, spec: str | None) -> str | None:
        if spec is None:
            return None
        from rlpipe.training.models import fetch_source, resolve_source

        if spec == "tiny":
            raise ValueError("task.policy_model 'tiny' is an untrained model: run `rlpipe sft` first and use "
                             "models:/NAME@base")
        return str(fetch_source(resolve_source(spec, self.settings, self.config), self.settings))


_CONTEXTS: dict[str, RunContext] = {}


def register_context(ctx: RunContext) -> RunContext:
    _CONTEXTS[ctx.run_id] = ctx
    return ctx


def forget_context(run_id: str) -> None:
    _CONTEXTS.pop(run_id, None)


def find_context(run_id: str) -> RunContext | None:
    """The registered context of ``run_id``, None outside an RL run (SFT, a reward-model fit, an evaluation)."""
    return _CONTEXTS.get(run_id)


def run_context(run_id: str, config: Any = None) -> RunContext:
    """The run's registered context; outside a train flow (a task called on its own), one resolved from
    ``config`` now and registered, so that later calls of the same run reuse it."""
    ctx = _CONTEXTS.get(run_id)
    if ctx is not None and (config is None or ctx.config is config or ctx.config == config):
        return ctx
    if not isinstance(config, RunConfig):
        raise RuntimeError(f"run {run_id!r} has no context in this process; the train flow resolves it "
                           "(run `rlpipe run`, or the `train` deployment)")
    return register_context(RunContext.resolve(config, run_id))

"""The preflight task: a run's first step checks every component it needs and fails fast, naming the one
that is down and its fix (the same checks as ``rlpipe doctor``)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlpipe.config import RunConfig, settings
from rlpipe.doctor import preflight
from tasks._log import run_logger


# No retries: a component that is down is reported at once; the run is started again once it is fixed.
@task(name="preflight", cache_policy=NO_CACHE, timeout_seconds=300)
def preflight_task(config: RunConfig) -> list[dict[str, Any]]:
    checks = preflight(config, settings())
    run_logger().info("preflight: %s", ", ".join(f"{c.component} {c.status}" for c in checks))
    for c in checks:
        if c.status == "skip" and c.component == "alert-inputs":  # alert rules this run cannot evaluate
            run_logger().warning("preflight: %s: %s", c.component, c.detail)
    return [c.as_dict() for c in checks]

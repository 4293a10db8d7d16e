"""Dataset tasks: build or load a prompt set, validate it, and store it under its content version."""

from __future__ import annotations

import importlib
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlpipe.config import RunConfig, settings
from rlpipe.data import BUILTIN, dataset_version, load_prompts, validate_prompts
from rlpipe.storage.layout import dataset_prefix
from rlpipe.storage.schemas import PROMPT_SCHEMA
from rlpipe.storage.store import open_store
from tasks._log import run_logger


class DatasetInvalid(ValueError):
    pass


@task(name="prepare-dataset", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE, timeout_seconds=600)
def prepare_dataset(config: RunConfig) -> dict[str, Any]:
    """Build/load → validate (refuse on any finding) → write the stage once per version."""
    for module in config.reward.plugins:  # extra verifiers: the prompt rows may name them
        importlib.import_module(module)
    if config.agent is not None:
        from rlpipe.data.episodes import build_episode_tasks, episode_task_findings

        spec = config.agent.spec()
        table, name = build_episode_tasks(spec, config.data), f"episodes-{spec.env}"
        problems = episode_task_findings(table, spec)
        if problems:
            raise DatasetInvalid(f"{name}: {len(problems)} task(s) the environment refuses:\n  " + "\n  ".join(problems[:20]))
        return _store_dataset(config, table, name)
    if config.task.dataset in BUILTIN:
        table, name = BUILTIN[config.task.dataset](config.data), config.task.dataset.split(":", 1)[1]
    else:
        table = load_prompts(config.task.dataset, default_task=config.reward.verifier)
        name = config.task.dataset.rsplit("/", 1)[-1].split(".")[0]
    if config.data.redact:  # the stored dataset, and so the prompts the policy reads, de-identified too
        from rlpipe.data.pii_files import redact_table

        table, replaced = redact_table(table)
        run_logger().info("data.redact: %d prompt value(s) de-identified", replaced)
    findings = validate_prompts(table, options=config.reward.verifier_options())
    if findings:
        shown = "\n".join(f"  {f}" for f in findings[:20])
        more = f"\n  … and {len(findings) - 20} more (run `rlpipe data validate {config.task.dataset}`)" if len(findings) > 20 else ""
        raise DatasetInvalid(f"{config.task.dataset}: {len(findings)} invalid row(s); nothing was dropped:\n{shown}{more}")
    return _store_dataset(config, table, name)


def _store_dataset(config: RunConfig, table: Any, name: str) -> dict[str, Any]:
    s = settings()
    version = dataset_version(table)
    store = open_store(s.resolve_storage_uri(config), s)
    prefix = dataset_prefix(name, version)
    if not store.stage_done(prefix):
        store.write_stage(prefix, [table], meta={"version": version, "source": config.task.dataset}, schema=PROMPT_SCHEMA)
    splits = table.column("split").to_pylist()
    ref = {
        "name": name,
        "version": version,
        "uri": store.url(prefix),
        "prefix": prefix,
        "rows": table.num_rows,
        "train_rows": splits.count("train"),
        "test_rows": splits.count("test"),
    }
    run_logger().info(
        "dataset %s version %s: %d train / %d test rows at %s",
        ref["name"], ref["version"][:12], ref["train_rows"], ref["test_rows"], ref["uri"],
    )
    return ref

"""Prefect flows: sft, prepare_data, train, iteration, evaluate, reward_model.

Per-shard progress bars of ``save_pretrained`` (one per iteration's save) are noise in a flow run's output,
whether it was started by the CLI (which sets the same default) or by a worker from a deployment.
"""

import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

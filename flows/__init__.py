"""Prefect flows: sft, prepare_data, train, iteration, evaluate, reward_model.

Per-shard progress bars of ``save_pretrained`` (one per iteration's save) are noise in a flow run's output,
whether it was started by the CLI (which sets the same default) or by a worker from a deployment.
Prefect's API clients share one TLS context per CA file instead of parsing it for each client
(``flows/_tls.py``: ~28 ms of CPU at the start of every iteration's flow run).
"""

import os

from flows._tls import share_tls_contexts

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
share_tls_contexts()

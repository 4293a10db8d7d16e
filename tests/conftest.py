"""Session-wide fixtures (per pytest-xdist worker): an isolated RLPIPE_HOME, one S3 server, one Prefect harness,
one tiny model."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

# Before anything imports prefect: its settings are read once.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# The suite starts a dozen vLLM engines in its one process (and more in the processes it starts); at vLLM-CPU's
# 1 GiB KV cache each the process neared the machine's 24 GB. The suite's models need a few MiB of it.
if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
    os.environ.setdefault("RLPIPE_VLLM_KV_CACHE_MB", "128")
# `make test` runs the suite in two pytest-xdist workers, each with its own session fixtures. Each gets its own
# sandbox uids (64 each, 100 apart below the default base), so that one worker's check for leftover sandbox
# processes (tests/sandbox/conftest.py) never sees the other's live ones.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and "RLPIPE_SANDBOX_UID_BASE" not in os.environ:
    os.environ["RLPIPE_SANDBOX_UID_BASE"] = str(61000 - 100 * int(_WORKER[2:]))


def _patient_httpx(timeout_s: float = 60.0) -> None:
    """The tests' own one-off calls (``httpx.get(url)``) wait up to ``timeout_s`` instead of httpx's 5 s: beside the
    other worker a server a test just started can take longer to answer its first request (the stack's MLflow
    server took over 5 s to create an experiment). rlpipe's own code always sets its timeouts; nor does this reach
    the processes the tests start."""
    import httpx

    for name in ("get", "post", "put", "patch", "delete", "head", "options", "request"):
        getattr(httpx, name).__kwdefaults__["timeout"] = httpx.Timeout(timeout_s)


_patient_httpx()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def rlpipe_home(tmp_path_factory) -> Path:
    """Every test writes under one temporary RLPIPE_HOME, never into the clone."""
    home = tmp_path_factory.mktemp("rlpipe-home")
    os.environ["RLPIPE_HOME"] = str(home)
    os.environ.setdefault("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect-home")))
    for var in ("RLPIPE_STORAGE_URI", "RLPIPE_TRACKING_URI", "RLPIPE_S3_ENDPOINT_URL"):
        os.environ.pop(var, None)
    return home


@pytest.fixture(autouse=True)
def _seed():
    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real SeaweedFS S3 server (auth enforced) on 127.0.0.1 for the whole session."""
    from tests.helpers.s3server import start_s3_server

    server = start_s3_server(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture(params=["local", "s3"])
def local_or_s3_store(request, tmp_path):
    """An object store in a local folder, then in the SeaweedFS bucket under a prefix of this test's own."""
    from rlpipe.storage import open_store

    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    server = request.getfixturevalue("s3_env")
    prefix = f"{request.module.__name__.rsplit('.', 1)[-1]}-{request.node.name.replace('[', '-').rstrip(']')}"
    return open_store(f"s3://{server.bucket}/{prefix}")


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test API for the session (its start costs ~20 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A small SFT-trained checkpoint in HF format (shared; do not modify)."""
    from rlpipe.config import RunConfig
    from rlpipe.data import build_arithmetic
    from rlpipe.training.checkpoint import save_checkpoint
    from rlpipe.training.sft import train_sft
    from rlpipe.training.tiny import build_char_tokenizer, build_tiny_model

    cfg = RunConfig.model_validate(
        {"model": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128},
         "sft": {"steps": 40, "batch_size": 32, "stop_at_accuracy": None}}
    )
    rows = [r for r in build_arithmetic(cfg.data).to_pylist() if r["split"] == "train"]
    tok = build_char_tokenizer()
    model = build_tiny_model(cfg.model, tok, seed=0)
    train_sft(model, tok, rows, cfg.sft, seed=0)
    folder = tmp_path_factory.mktemp("tiny-ckpt")
    save_checkpoint(folder, model, tok, trainer_state={"kind": "sft"})
    return folder


@pytest.fixture(scope="session")
def tiny_reward_model(tiny_checkpoint, tmp_path_factory):
    """A reward model trained briefly on the tiny checkpoint's trunk: right answers over letters (shared; do not modify).

    Returns (folder, trainer result, held-out pair accuracy)."""
    from rlpipe.config import RewardModelConfig
    from rlpipe.training.reward_model import RewardModelTrainer, encode_pairs

    rows = [{"prompt": f"{a}+{b}=", "chat": False, "chosen": str(a + b), "rejected": "xy"[(a + b) % 2] + "q",
             "margin": None} for a in range(10, 40) for b in range(10, 30)]
    cfg = RewardModelConfig(steps=40, lr=1e-3, batch_size=16, micro_batch_size=8, eval_every=10, patience=3)
    trainer = RewardModelTrainer(tiny_checkpoint, cfg, seed=0)
    pairs = encode_pairs(trainer.tokenizer, rows)
    before = trainer.evaluate(pairs[550:])
    result = trainer.train(pairs[:500], pairs[500:550])
    held_out = trainer.evaluate(pairs[550:]) | {"before": before["pair_accuracy"], "gap_before": before["score_gap"]}
    folder = tmp_path_factory.mktemp("tiny-rm")
    trainer.save(folder, trainer.reward_stats(pairs[:500]))
    return folder, result, held_out


@pytest.fixture(scope="session")
def standins(tmp_path_factory) -> dict[str, Path]:
    """Hub-style stand-in checkpoints of two families (shared; do not modify): 'qwen2' (ChatML, EOS an int, tied
    embeddings, bf16, vocabulary 716) and 'llama' (Llama-3 template, EOS a list, no pad token, untied, fp16,
    vocabulary 1000). See rlpipe.training.standin."""
    from rlpipe.training.standin import build_standin

    root = tmp_path_factory.mktemp("standins")
    return {arch: build_standin(root / arch, arch) for arch in ("qwen2", "llama")}

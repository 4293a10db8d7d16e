import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "dist_update.py"


def _launch(model, out, nproc, zero, kl=0.0):
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    from tests.helpers.s3server import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           str(SCRIPT), "--model", str(model), "--out", str(out), "--zero", str(zero), "--kl", str(kl)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "metrics.json").read_text()), load_file(out / "model.safetensors")


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_two_ranks_give_the_same_update_as_one(tiny_checkpoint, tmp_path, zero):
    m1, w1 = _launch(tiny_checkpoint, tmp_path / "one", 1, zero, kl=0.05)
    m2, w2 = _launch(tiny_checkpoint, tmp_path / "two", 2, zero, kl=0.05)
    assert m1["world"] == 1 and m2["world"] == 2
    before = load_file(Path(tiny_checkpoint) / "model.safetensors")
    moved = max(float((w1[k] - before[k]).abs().max()) for k in w1)
    assert moved > 1e-4  # the update did something
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=2e-6, rtol=1e-5), k
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "tokens"):
        assert abs(m1["metrics"][key] - m2["metrics"][key]) < 1e-5 * max(1.0, abs(m1["metrics"][key])), key
    assert m1["metrics"]["samples_excluded"] == 4 and m1["metrics"]["optimizer_steps"] == 3

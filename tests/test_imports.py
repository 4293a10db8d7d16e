import subprocess
import sys

CORE = [
    "rlpipe", "rlpipe.config", "rlpipe.storage", "rlpipe.storage.layout", "rlpipe.data", "rlpipe.rewards",
    "rlpipe.training.tiny", "rlpipe.training.sft", "rlpipe.training.checkpoint", "rlpipe.training.models",
    "rlpipe.tracking.mlflow_utils", "rlpipe.runs", "rlpipe.envs", "rlpipe.envs.calculator", "rlpipe.envs.guess",
    "rlpipe.doctor",
]
FORBIDDEN = ["prefect", "mlflow", "boto3", "vllm", "deepspeed"]


def test_core_imports_without_orchestration_or_engines():
    code = (
        "import sys\n"
        f"for m in {CORE!r}: __import__(m)\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"core modules imported {out.stdout.strip()}"


def test_import_has_no_side_effects(tmp_path):
    code = f"import os; os.chdir({str(tmp_path)!r}); " + "; ".join(f"import {m}" for m in CORE) + "; print(sorted(os.listdir('.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

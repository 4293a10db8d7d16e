import subprocess
import sys

CORE = [
    "rlpipe", "rlpipe.config", "rlpipe.storage", "rlpipe.storage.layout", "rlpipe.data", "rlpipe.rewards",
    "rlpipe.training.tiny", "rlpipe.training.sft", "rlpipe.training.checkpoint", "rlpipe.training.models",
    "rlpipe.tracking.mlflow_utils", "rlpipe.runs", "rlpipe.envs", "rlpipe.envs.calculator", "rlpipe.envs.guess",
    "rlpipe.doctor", "rlpipe.evaluation", "rlpipe.eval_suite",
]
FORBIDDEN = ["prefect", "mlflow", "boto3", "vllm", "deepspeed"]


def test_core_imports_without_orchestration_or_engines():
    # What transformers' own modeling code brings is not rlpipe's import: with accelerate installed (peft's
    # dependency, for LoRA), transformers imports it, and accelerate imports boto3 for its SageMaker config
    # whenever boto3 is installed. rlpipe's core must add none of the forbidden modules beyond that.
    code = (
        "import sys\n"
        "import transformers.modeling_utils\n"
        "before = set(sys.modules)\n"
        f"for m in {CORE!r}: __import__(m)\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules and m not in before]\n"
        f"print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"core modules imported {out.stdout.strip()}"


def test_import_has_no_side_effects(tmp_path):
    code = f"import os; os.chdir({str(tmp_path)!r}); " + "; ".join(f"import {m}" for m in CORE) + "; print(sorted(os.listdir('.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_transformers_brings_nothing_forbidden_but_accelerates_boto3():
    """The allowance above stays narrow: transformers' modeling code imports none of the forbidden modules but
    boto3 (through accelerate)."""
    code = ("import sys, transformers.modeling_utils\n"
            f"print(','.join(m for m in {FORBIDDEN!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert set(filter(None, out.stdout.strip().split(","))) <= {"boto3"}

#!/usr/bin/env bash
# Build a separate virtual environment with TRL for benchmarks/trl_grpo.py.
#
# It is kept apart from the project venv on purpose: installing trl there could
# replace the pinned transformers/torch. torch is installed FIRST and pinned to
# the CPU build (2.13.0+cpu, available as a local wheel); an unpinned torch would
# pull a multi-GB CUDA build.
#
# Usage: bash benchmarks/setup_trl_venv.sh [VENV_DIR]   (default ~/.cache/rlpipe/bench-trl)
set -euo pipefail

VENV="${1:-$HOME/.cache/rlpipe/bench-trl}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.19.0}"
# trl 1.16.0 is the version this benchmark was written and checked against.
TRL_SPEC="${TRL_SPEC:-trl==1.16.0}"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PIP="$VENV/bin/pip"

"$PIP" install "torch==${TORCH_VERSION}"
"$PIP" install "$TRL_SPEC" "transformers==${TRANSFORMERS_VERSION}" tokenizers math-verify "torch==${TORCH_VERSION}"

# Fail loudly if anything replaced the CPU torch build.
"$VENV/bin/python" - <<'EOF'
import torch, transformers, trl
print(f"torch {torch.__version__}  transformers {transformers.__version__}  trl {trl.__version__}")
if torch.version.cuda is not None or "+cpu" not in torch.__version__:
    raise SystemExit(f"expected a CPU-only torch build, got {torch.__version__} (cuda={torch.version.cuda})")
EOF

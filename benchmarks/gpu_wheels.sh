#!/usr/bin/env bash
# The Python packages rlpipe's GPU check needs beyond a CUDA machine's stock image (torch, numpy, pyarrow, sympy, ...),
# as wheels in .whl/ (ignored by git), for a machine that reaches no package registry: Python 3.12, x86-64.
# Versions are this repository's pins (requirements/lock-cpu.txt). DeepSpeed ships as source only: its wheel is
# built here (no compiled ops; it compiles what it needs on first use), with this checkout's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
pin() { grep -i "^$1==" requirements/lock-cpu.txt | cut -d= -f3; }
mkdir -p .whl
names=(pydantic pydantic_core annotated-types typing-inspection typing_extensions hjson math-verify latex2sympy2_extended
       antlr4-python3-runtime transformers tokenizers)
args=()
for n in "${names[@]}"; do args+=("$n==$(pin "$n")"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${args[@]}"
DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation "deepspeed==$(pin deepspeed)" -w .whl
ls -1 .whl

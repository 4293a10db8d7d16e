#!/usr/bin/env bash
# All GRPO benchmarks in sequence (run on an otherwise idle machine; ~15 min at --samples 8192).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD"
samples=${SAMPLES:-8192}
out=${OUT:-/tmp/rlpipe-bench}
mkdir -p "$out"
make install
.venv/bin/python benchmarks/grpo_loop.py --samples "$samples" --home "$out/home" --out "$out/rlpipe.json"
bash benchmarks/setup_trl_venv.sh
.venv/bin/python benchmarks/export_arith.py --out "$out/arith.jsonl"
model=$(.venv/bin/python -c "import json; print(json.load(open('$out/rlpipe.json'))['base_model'])")
~/.cache/rlpipe/bench-trl/bin/python benchmarks/trl_grpo.py --model "$model" --data "$out/arith.jsonl" \
  --samples "$samples" --out "$out/trl.json"
echo "results: $out/rlpipe.json $out/trl.json"

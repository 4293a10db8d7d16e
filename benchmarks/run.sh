#!/usr/bin/env bash
# The GRPO side by side with TRL (run on an otherwise idle machine; ~4 min per pair at --samples 8192 once the
# SFT base exists). PAIRS=n runs rlpipe and TRL n times, alternating, so that drift in the machine's speed
# falls on both; side_by_side.py prints each pair's ratio and the spread.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD"
samples=${SAMPLES:-8192}
pairs=${PAIRS:-1}
out=${OUT:-/tmp/rlpipe-bench}
mkdir -p "$out"
make install
bash benchmarks/setup_trl_venv.sh
.venv/bin/python benchmarks/export_arith.py --out "$out/arith.jsonl"
for k in $(seq 1 "$pairs"); do
  .venv/bin/python benchmarks/grpo_loop.py --samples "$samples" --home "$out/home" --out "$out/rlpipe-$k.json" \
    $( [ "$k" -gt 1 ] && echo --skip-engines )
  model=$(.venv/bin/python -c "import json; print(json.load(open('$out/rlpipe-$k.json'))['base_model'])")
  ~/.cache/rlpipe/bench-trl/bin/python benchmarks/trl_grpo.py --model "$model" --data "$out/arith.jsonl" \
    --samples "$samples" --out "$out/trl-$k.json"
done
.venv/bin/python benchmarks/side_by_side.py "$out" --pairs "$pairs"

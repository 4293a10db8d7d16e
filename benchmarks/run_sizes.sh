#!/usr/bin/env bash
# rlpipe's GRPO loop and TRL's GRPOTrainer side by side at one larger model size (issue 43): the same SFT base
# (built from config at benchmarks/scaling.py's MODELS[SIZE], trained once in its own RLPIPE_HOME), the same data,
# the same batch settings and the same number of completions on both sides; PAIRS runs alternating rlpipe/TRL,
# then side_by_side.py prints seconds per sample (completion) and each pair's ratio. Run on an otherwise idle
# machine. Needs `make install` and `bash benchmarks/setup_trl_venv.sh` done once.
#
#   SIZE=30M  SFT_STEPS=60 SAMPLES=3072 PAIRS=2 bash benchmarks/run_sizes.sh    (as run 2026-12-06, 02:05 UTC)
#   SIZE=100M SFT_STEPS=20 SAMPLES=3008 PAIRS=2 bash benchmarks/run_sizes.sh
#
# Settings (defaults): PROMPTS=8 prompts × GENERATIONS=8 samples = 64 completions per iteration, STEP=16 completions
# per optimizer step (4 steps per iteration, as the demo's 256 / 64; one forward/backward per step on both sides),
# EVAL_SIZE=500 held-out questions (the whole test split), before and after. OUT (default
# /tmp/rlpipe-bench/sizes-$SIZE) gets rlpipe-k.json, trl-k.json, their logs and side_by_side.json.
# SFT_ONLY=1 stops after training the SFT base (and a one-iteration run that proves the settings).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD"
size=${SIZE:?SIZE=30M or SIZE=100M}
samples=${SAMPLES:-2048}
pairs=${PAIRS:-2}
prompts=${PROMPTS:-8}
generations=${GENERATIONS:-8}
step=${STEP:-16}
eval_size=${EVAL_SIZE:-500}
sft_steps=${SFT_STEPS:-}
out=${OUT:-/tmp/rlpipe-bench/sizes-$size}
home=${HOME_DIR:-/tmp/rlpipe-bench/home-$size}
trl_py=${TRL_PYTHON:-$HOME/.cache/rlpipe/bench-trl/bin/python}
mkdir -p "$out"
[ -x "$trl_py" ] || { echo "no TRL venv at $trl_py: run bash benchmarks/setup_trl_venv.sh" >&2; exit 1; }
[ -s "$out/arith.jsonl" ] || .venv/bin/python benchmarks/export_arith.py --out "$out/arith.jsonl"
batch=(--prompts-per-iter "$prompts" --num-generations "$generations" --completions-per-step "$step" --eval-size "$eval_size")
# A base trained in bounded time may score 0 on every sample of an iteration: the reward_flat alert (critical) would
# hold the run, so it is off here (an alert check costs nothing measurable either way).
loop=(.venv/bin/python benchmarks/grpo_loop.py --model-size "$size" --home "$home" --skip-engines "${batch[@]}"
      --set alerts.reward_flat.enabled=false ${sft_steps:+--sft-steps "$sft_steps"})
if [ -n "${SFT_ONLY:-}" ]; then
  "${loop[@]}" --samples $((prompts * generations)) --out "$out/sft-check.json"
  exit 0
fi
for k in $(seq 1 "$pairs"); do
  echo "[run_sizes $(date -u +%H:%M:%S)] pair $k: rlpipe" >&2
  "${loop[@]}" --samples "$samples" --out "$out/rlpipe-$k.json" > "$out/rlpipe-$k.log" 2>&1
  model=$(.venv/bin/python -c "import json; print(json.load(open('$out/rlpipe-$k.json'))['base_model'])")
  echo "[run_sizes $(date -u +%H:%M:%S)] pair $k: TRL" >&2
  "$trl_py" benchmarks/trl_grpo.py --model "$model" --data "$out/arith.jsonl" --samples "$samples" "${batch[@]}" \
    --out "$out/trl-$k.json" > "$out/trl-$k.log" 2>&1
done
echo "[run_sizes $(date -u +%H:%M:%S)] done" >&2
.venv/bin/python benchmarks/side_by_side.py "$out" --pairs "$pairs" | tee "$out/side_by_side.md"

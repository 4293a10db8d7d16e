#!/usr/bin/env bash
# LoRA against full fine-tuning on the arithmetic demo: one SFT base (configs/sft-arithmetic.yaml, seed 0), then the
# demo's GRPO (configs/grpo-arithmetic.yaml, 80 iterations) from it with each seed, full and with LoRA; prints the
# held-out accuracy each ends at.
#   bash benchmarks/lora_vs_full.sh OUT_DIR "0 1 2" [LORA_LR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?OUT_DIR}
seeds=${2:-0 1 2}
lora_lr=${3:-3e-4}
mkdir -p "$out"
export PYTHONHASHSEED=0 PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 PREFECT_SERVER_ANALYTICS_ENABLED=false
export RLPIPE_HOME="$out/home"
rm -rf "$RLPIPE_HOME"
"$root/.venv/bin/rlpipe" sft "$root/configs/sft-arithmetic.yaml" > "$out/sft.log" 2>&1
for seed in $seeds; do
  for mode in full lora; do
    extra=()
    if [ "$mode" = lora ]; then extra=(--set "train.lora={r: 16, alpha: 32}" --set "train.lr=$lora_lr"); fi
    start=$(date +%s)
    "$root/.venv/bin/rlpipe" run "$root/configs/grpo-arithmetic.yaml" --run-id "$mode-$seed" --set seed="$seed" \
      "${extra[@]}" > "$out/$mode-$seed.log" 2>&1
    summary="$RLPIPE_HOME/runs/$mode-$seed/summary.json"
    "$root/.venv/bin/python" -c "import json,sys; s=json.load(open(sys.argv[1])); print(f\"$mode seed $seed: {s['heldout_accuracy_base']:.3f} -> {s['heldout_accuracy_final']:.3f} in $(( $(date +%s) - start )) s\")" "$summary"
  done
done

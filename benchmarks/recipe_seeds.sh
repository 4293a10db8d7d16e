#!/usr/bin/env bash
# A recipe (SFT config, then RL config) over several seeds, each in its own RLPIPE_HOME; prints base → final.
#   bash benchmarks/recipe_seeds.sh SFT.yaml RL.yaml [OUT_DIR] [SEEDS...]
#   e.g. bash benchmarks/recipe_seeds.sh configs/sft-expressions.yaml configs/grpo-expressions.yaml /tmp/rlpipe-expr 0 1 2
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sft=$1 rl=$2 out=${3:-/tmp/rlpipe-recipe-seeds}
shift 3 || shift $#
seeds=${*:-0 1 2}
mkdir -p "$out"
export PYTHONHASHSEED=0 PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 PREFECT_SERVER_ANALYTICS_ENABLED=false
for seed in $seeds; do
  home="$out/seed$seed"
  rm -rf "$home"
  start=$(date +%s)
  RLPIPE_HOME="$home" "$root/.venv/bin/rlpipe" sft "$root/$sft" --set seed="$seed" > "$out/seed$seed-sft.log" 2>&1
  RLPIPE_HOME="$home" "$root/.venv/bin/rlpipe" run "$root/$rl" --set seed="$seed" > "$out/seed$seed-rl.log" 2>&1
  echo "seed $seed: $(( $(date +%s) - start )) s"
done
"$root/.venv/bin/python" - "$out" $seeds <<'PY'
import json, sys, pathlib
out, seeds = pathlib.Path(sys.argv[1]), sys.argv[2:]
print("| seed | SFT steps | base (test) | final (test) | gain | RL iterations | RL s |")
print("|---:|---:|---:|---:|---:|---:|---:|")
gains = []
for seed in seeds:
    runs = out / f"seed{seed}" / "runs"
    r = json.loads(next(runs.glob("rl-*/summary.json")).read_text())
    s = json.loads(next(runs.glob("sft-*/summary.json")).read_text())
    gain = 100 * (r["heldout_accuracy_final"] - r["heldout_accuracy_base"])
    gains.append(gain)
    print(f"| {seed} | {s.get('sft_steps')} | {r['heldout_accuracy_base']:.1%} | {r['heldout_accuracy_final']:.1%} | "
          f"{gain:+.1f} | {r['iterations_done']} | {r['wall_s']:.0f} |")
print(f"gain: min {min(gains):+.1f}, mean {sum(gains) / len(gains):+.1f}, max {max(gains):+.1f} points")
PY

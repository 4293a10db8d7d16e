#!/usr/bin/env bash
# `rlpipe demo` over several seeds, each in its own RLPIPE_HOME; prints base → final per seed.
#   bash benchmarks/demo_seeds.sh [OUT_DIR] [SEEDS...]     (default /tmp/rlpipe-demo-seeds, seeds 0 1 2; ~8 min each)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-/tmp/rlpipe-demo-seeds}
shift || true
seeds=${*:-0 1 2}
mkdir -p "$out"
export PYTHONHASHSEED=0 PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 PREFECT_SERVER_ANALYTICS_ENABLED=false
for seed in $seeds; do
  home="$out/seed$seed"
  rm -rf "$home"
  start=$(date +%s)
  RLPIPE_HOME="$home" "$root/.venv/bin/rlpipe" demo --set seed="$seed" > "$out/seed$seed.log" 2>&1
  echo "seed $seed: $(( $(date +%s) - start )) s"
done
"$root/.venv/bin/python" - "$out" $seeds <<'PY'
import json, sys, pathlib
out, seeds = pathlib.Path(sys.argv[1]), sys.argv[2:]
print("| seed | SFT steps | base (test) | final (test) | gain | final validation | RL s | mismatch abs_max (max over iterations) |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
gains = []
for seed in seeds:
    runs = out / f"seed{seed}" / "runs"
    rl = next(p for p in runs.glob("rl-*/summary.json"))
    sft = next(p for p in runs.glob("sft-*/summary.json"))
    r, s = json.loads(rl.read_text()), json.loads(sft.read_text())
    hist = json.loads((rl.parent / "progress.json").read_text())["history"]
    mm = max(h.get("mismatch/abs_max", 0.0) for h in hist)
    gain = 100 * (r["heldout_accuracy_final"] - r["heldout_accuracy_base"])
    gains.append(gain)
    val = json.loads((rl.parent / "progress.json").read_text()).get("final_validation_accuracy")
    print(f"| {seed} | {s.get('sft_steps')} | {r['heldout_accuracy_base']:.1%} | {r['heldout_accuracy_final']:.1%} | "
          f"{gain:+.1f} | {val:.1%} | {r['wall_s']:.0f} | {mm:.2e} |")
print(f"gain: min {min(gains):+.1f}, mean {sum(gains) / len(gains):+.1f}, max {max(gains):+.1f} points")
PY

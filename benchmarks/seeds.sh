#!/usr/bin/env bash
# A recipe over several seeds, each in its own RLPIPE_HOME, one after the other; prints base → final.
#   bash benchmarks/seeds.sh OUT_DIR "0 1 2"                       # `rlpipe demo --set seed=N` (~8 min each)
#   bash benchmarks/seeds.sh OUT_DIR "0 1 2" SFT.yaml RL.yaml      # `rlpipe sft SFT.yaml`, then `rlpipe run RL.yaml`
#   bash benchmarks/seeds.sh OUT_DIR "0 1 2" rlhf                  # `rlpipe demo rlhf --set seed=N` (~7 min each)
#   bash benchmarks/seeds.sh OUT_DIR "0 1 2" agent                 # `rlpipe demo agent --set seed=N` (~9 min each)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?OUT_DIR}
seeds=${2:-0 1 2}
sft=${3:-} rl=${4:-}
mkdir -p "$out"
export PYTHONHASHSEED=0 PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 PREFECT_SERVER_ANALYTICS_ENABLED=false
for seed in $seeds; do
  export RLPIPE_HOME="$out/seed$seed"
  rm -rf "$RLPIPE_HOME"
  start=$(date +%s)
  if [ -z "$sft" ]; then
    "$root/.venv/bin/rlpipe" demo --set seed="$seed" > "$out/seed$seed.log" 2>&1
  elif [ "$sft" = rlhf ] || [ "$sft" = agent ]; then
    "$root/.venv/bin/rlpipe" demo "$sft" --set seed="$seed" > "$out/seed$seed.log" 2>&1
  else
    "$root/.venv/bin/rlpipe" sft "$root/$sft" --set seed="$seed" > "$out/seed$seed-sft.log" 2>&1
    "$root/.venv/bin/rlpipe" run "$root/$rl" --set seed="$seed" > "$out/seed$seed-rl.log" 2>&1
  fi
  echo "seed $seed: $(( $(date +%s) - start )) s"
done
if [ "$sft" = agent ]; then
"$root/.venv/bin/python" - "$out" $seeds <<'PY'
import json, sys, pathlib
out, seeds = pathlib.Path(sys.argv[1]), sys.argv[2:]
print("| seed | SFT steps | episode success base → final | gain | steps base → final | tool calls base → final | env errors | demo s |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
gains = []
for seed in seeds:
    runs = out / f"seed{seed}" / "runs"
    d = json.loads(next(runs.glob("agent-demo-*/summary.json")).read_text())
    s = json.loads(next(runs.glob("sft-*/summary.json")).read_text())
    gain = 100 * (d["episode_success_final"] - d["episode_success_base"])
    gains.append(gain)
    print(f"| {seed} | {s['sft_steps']} | {d['episode_success_base']:.1%} → {d['episode_success_final']:.1%} | {gain:+.1f} | "
          f"{d['mean_steps_base']:.2f} → {d['mean_steps']:.2f} | {d['tool_calls_per_episode_base']:.2f} → "
          f"{d['tool_calls_per_episode']:.2f} | {d['episodes_error_total']} | {d['wall_s']:.0f} |")
print(f"gain: min {min(gains):+.1f}, mean {sum(gains) / len(gains):+.1f}, max {max(gains):+.1f} points")
PY
exit 0
fi
if [ "$sft" = rlhf ]; then
"$root/.venv/bin/python" - "$out" $seeds <<'PY'
import json, sys, pathlib
out, seeds = pathlib.Path(sys.argv[1]), sys.argv[2:]
print("| seed | RM steps | RM pair accuracy (test) | true score base → final | gain | RM score base → final | exact-match base → final | hacking alerts | demo s |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
gains = []
for seed in seeds:
    runs = out / f"seed{seed}" / "runs"
    d = json.loads(next(runs.glob("rlhf-demo-*/summary.json")).read_text())
    rm = json.loads(pathlib.Path(d["rm_summary"]).read_text())
    gain = d["heldout_true_score_final"] - d["heldout_true_score_base"]
    gains.append(gain)
    print(f"| {seed} | {rm['rm_steps']} | {d['rm_pair_accuracy']:.3f} | {d['heldout_true_score_base']:.3f} → "
          f"{d['heldout_true_score_final']:.3f} | {gain:+.3f} | {d['heldout_rm_score_base']:.2f} → {d['heldout_rm_score_final']:.2f} | "
          f"{d['heldout_accuracy_base']:.1%} → {d['heldout_accuracy_final']:.1%} | {d['reward_hacking_alerts']} | {d['wall_s']:.0f} |")
print(f"true-score gain: min {min(gains):+.3f}, mean {sum(gains) / len(gains):+.3f}, max {max(gains):+.3f}")
PY
exit 0
fi
"$root/.venv/bin/python" - "$out" $seeds <<'PY'
import json, sys, pathlib
out, seeds = pathlib.Path(sys.argv[1]), sys.argv[2:]
from rlpipe.history import read_history

print("| seed | SFT steps | base (test) | final (test) | gain | final validation | RL iterations | RL s | mismatch abs_max |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
gains = []
for seed in seeds:
    runs = out / f"seed{seed}" / "runs"
    rl = next(runs.glob("rl-*/summary.json"))
    r, s = json.loads(rl.read_text()), json.loads(next(runs.glob("sft-*/summary.json")).read_text())
    progress = json.loads((rl.parent / "progress.json").read_text())
    mm = max(h.get("mismatch/abs_max", 0.0) for h in read_history(rl.parent))  # the history left progress.json
    val = progress.get("final_validation_accuracy")
    gain = 100 * (r["heldout_accuracy_final"] - r["heldout_accuracy_base"])
    gains.append(gain)
    print(f"| {seed} | {s.get('sft_steps')} | {r['heldout_accuracy_base']:.1%} | {r['heldout_accuracy_final']:.1%} | "
          f"{gain:+.1f} | {'—' if val is None else f'{val:.1%}'} | {r['iterations_done']} | {r['wall_s']:.0f} | {mm:.2e} |")
print(f"gain: min {min(gains):+.1f}, mean {sum(gains) / len(gains):+.1f}, max {max(gains):+.1f} points")
PY

#!/usr/bin/env bash
# The GPU checks in one run, for a CUDA machine with a stock PyTorch image and no registry (benchmarks/gpu_wheels.sh
# prepares .whl/ beforehand): the @pytest.mark.gpu tests, then benchmarks/gpu_iteration.py in bf16 and in bf16_weights
# (every model) and in fp32 (100M). Results and logs go to $OUT (default /tmp/rlpipe-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/rlpipe-gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1
timeout "${TEST_S:-70}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/training/test_trainer_cuda.py \
  tests/rollout/test_hf_engine_cuda.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
echo "gpu tests exit ${PIPESTATUS[0]}"
timeout "${BENCH_S:-190}" python3 benchmarks/gpu_iteration.py --precision bf16 --iterations 3 --out "$OUT/gpu-bf16.json" 2>&1 \
  | grep -v -i "warn" | tee "$OUT/gpu-bf16.log" | tail -30
timeout "${BF16W_S:-120}" python3 benchmarks/gpu_iteration.py --precision bf16_weights --iterations 3 --out "$OUT/gpu-bf16w.json" 2>&1 \
  | grep -v -i "warn" | tee "$OUT/gpu-bf16w.log" | tail -30
timeout "${FP32_S:-60}" python3 benchmarks/gpu_iteration.py --precision fp32 --models 100M --iterations 3 --out "$OUT/gpu-fp32.json" 2>&1 \
  | grep -v -i "warn" | tee "$OUT/gpu-fp32.log" | tail -12

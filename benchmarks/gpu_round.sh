#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests of the serving loop (fused boundary, model
# kernels, overlapped decode loop with graphs), then the end-to-end benchmark. From the
# project root, after ../shared/device/stage.sh here, with carry [".device-extras"]:
#   bash benchmarks/gpu_round.sh [pytest files...]
# Writes $OUT/tests.log, $OUT/e2e.json and $OUT/e2e.log (OUT defaults to /tmp/gpu-round).
set -uo pipefail
cd "$(dirname "$0")/.."
source .device-extras/activate.sh
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu-round}
mkdir -p "$out"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_rotary_boundary.py tests/test_model_ops.py tests/test_decode_loop_gpu.py)
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -x -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$out/tests.log" | tail -25
timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/bench_e2e.py --out "$out/e2e.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/e2e.log" | tail -70

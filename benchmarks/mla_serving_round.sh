#!/usr/bin/env bash
# One call on the GPU machine for latent-attention (MLA) serving, what the H100 run of
# benchmarks/results/e2e-mla-subset-h100-2026-12-06.md left to measure. From the project root,
# after ../shared/device/stage.sh here, with carry [".device-extras"]:
#   bash benchmarks/mla_serving_round.sh
# 1. on an H200 only: the MLA decode kernels over bf16 and fp8 latents (issue 24's 85%);
# 2. the MLA tests on the GPU (the absorbed-subset, mixed-graph, boundary and prefill-index cases among them);
# 3. bench_e2e's DeepSeek-V2-Lite burst and Poisson runs, mixed steps eager (--no-latent-mixed-graphs)
#    and captured (the default since e42fa09), alternating, $RUNS times each (default 1);
# 4. host_profile.py on the Poisson workload's eager mixed steps.
# Writes logs and JSON under $OUT (default /tmp/mla-round). Its lean form ran on an H100 in 150 s
# (benchmarks/results/e2e-mla-graphs-h100-2026-12-06.sh.txt: about a minute a bench_e2e run).
set -uo pipefail
cd "$(dirname "$0")/.."
source .device-extras/activate.sh
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/mla-round}
mkdir -p "$out"
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $name"
if echo "$name" | grep -q H200; then
    timeout 150 python3 benchmarks/bench_mla_decode.py --plan-only --fp8 --batches 64x4096,lognormal-128,512x512 \
        --rep-ms 40 --out "$out/mla-decode-h200.json" 2>&1 | tee "$out/mla-decode.log" | tail -30
fi
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -x -p no:cacheprovider -n 8 \
    tests/test_latent_attention.py tests/test_latent_boundary.py tests/test_mla_prefill.py \
    tests/test_mla_prefill_hopper.py 2>&1 | tee "$out/tests.log" | tail -5
e2e() {  # tag, extra arguments
    timeout 150 python3 benchmarks/bench_e2e.py --skip-transformers --model deepseek-v2-lite \
        --workloads burst,poisson "${@:2}" --out "$out/e2e-$1.json" > "$out/e2e-$1.log" 2>&1
    echo "e2e $1: rc=$?"
    grep -E "^(profile|prefill profile)|tokens/s|inter-token|mixed iteration" "$out/e2e-$1.log" | cut -c1-220
}
for run in $(seq "${RUNS:-1}"); do
    e2e "eager-$run" --profile-prefill --no-latent-mixed-graphs
    e2e "graphs-$run"
done
timeout 150 python3 benchmarks/host_profile.py --top 30 -- --model deepseek-v2-lite --workloads poisson \
    --no-latent-mixed-graphs 2>&1 | tee "$out/host-profile.log" | cut -c1-200 | tail -80

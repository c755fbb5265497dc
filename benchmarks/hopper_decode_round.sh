#!/usr/bin/env bash
# A GPU round of the Hopper decode kernel (attention/triton_kernels/decode_hopper.py;
# TritonBackend(hopper_decode=True)), in stages that fit one device call each (a stage stops
# at its timeout; the next still runs).
# From the project root, after ../shared/device/stage.sh here, with carry [".device-extras"]:
#   bash benchmarks/hopper_decode_round.sh [tests] [decode] [e2e] [mla] [burst] [burst-e2e] [direct-e2e]
#       [short-blocks-e2e] [dequant-e2e] [value-runs-e2e] [stall-e2e] [ratio-e2e] [overlap] [suite]
# (no stage named: tests and decode). Writes <stage>.log (and the benchmarks' JSON) under $OUT
# (default /tmp/hopper-round) and prints a summary last. The device returns about 8 files of
# $OUT a call, so the files are packed into $OUT/round.tgz at the end (unpack it where it
# comes back), beside the summary.
#   tests:  the Hopper decode tests and the backend's (a wrong TMA byte count hangs on an
#           mbarrier, hence the timeout)
#   decode: bench_decode's Hopper variants against the default launches and flash-attn
#   e2e:    the end-to-end burst, bf16 and fp8 caches, the Gluon kernel against the Triton
#           kernel (bf16: the default against --hopper-decode never; fp8 at block 256: the
#           default against --hopper-decode)
#   mla:    bench_mla_decode at the plan's launch (issue 24's 85%-of-copy target)
#   burst:  bench_decode's fp8 sweep and Hopper variants on the end-to-end burst's decode step
#           (128 rows of ~640 tokens: where fp8 reads at ~78% of the copy rate end to end)
#   burst-e2e: the burst end to end, bf16 and fp8 defaults and the fixed launches of
#           $E2E_LAUNCHES (bench_e2e.py --decode-launch words, ";"-separated; each a cache dtype
#           then the words, e.g. "fp8 n128 w4 s3 p3;bf16 n64 w4 s2 c1"; empty: none);
#           $E2E_WORKLOADS (default burst; e.g. burst,poisson)
#   short-blocks-e2e: fp8 at block 32, burst and Poisson: the default (the Gluon kernel) against
#           the Triton launch (--hopper-decode never)
#   dequant-e2e: the Poisson run over fp8 and int8 caches, graph steps' prefill rows on the
#           Triton kernel against the Hopper kernel over a 16-bit copy (--graph-dequant-prefill)
#   value-runs-e2e: the Poisson run over fp8 and int8 caches, prefill rows' token-major V
#           written in coalesced runs (the default) against token by token (--no-value-runs)
#   stall-e2e: the fp8 burst ($STALL_BLOCK, default 256) on the Triton and the Gluon decode
#           kernel, twice each, alternating: kernels compiled while serving, slowest iterations
#   ratio-e2e: benchmarks/e2e_cache_ratio.py: the burst over bf16 and fp8 caches, $RATIO_PAIRS (2)
#           pairs alternating: the fp8 / bf16 attention ratio against 0.6x
#   overlap: the Gluon decode kernel's overlapped loop (DecodeConfig.hopper_overlap) against its
#           loop in turn: its GPU tests, bench_decode's 3-tile rings of both loops (fp8 and bf16;
#           the burst's decode step, 64x4096, 32x512), then e2e_cache_ratio with the Gluon kernel
#           for fp8 too (--hopper-decode always), in turn and overlapped, $RATIO_PAIRS (1) pairs each
#   direct-e2e: the burst and the Poisson run end to end, bf16 and fp8 caches, the default
#           (each graph bucket also captured without the decode combine, replayed where no row
#           splits) against --no-direct-decode-graphs (one graph a bucket)
#   suite:  the whole test suite with -n 12
set -uo pipefail
cd "$(dirname "$0")/.."
source .device-extras/activate.sh
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/hopper-round}
mkdir -p "$out"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests decode)
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
summary=()

timed() {  # name, timeout seconds, command...: runs it into $out/<name>.log, notes rc and seconds
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    summary+=("$name: rc $rc ($([ $rc -eq 124 ] && echo 'timed out, ')$(($(date +%s) - start)) s)")
    tail -40 "$out/$name.log"
}

poisson_8bit_pair() {  # default-name, flagged-name, flag: the Poisson run over fp8 and int8, without and with flag
    local plain=$1 flagged=$2 flag=$3 cache
    local e2e=(python3 benchmarks/bench_e2e.py --skip-transformers --workloads poisson)
    for cache in float8_e4m3 int8; do
        timed "e2e-$cache-$plain" "${E2E_TIMEOUT:-150}" "${e2e[@]}" --kv-cache-dtype "$cache" \
            --out "$out/e2e-$cache-$plain.json"
        timed "e2e-$cache-$flagged" "${E2E_TIMEOUT:-150}" "${e2e[@]}" --kv-cache-dtype "$cache" "$flag" \
            --out "$out/e2e-$cache-$flagged.json"
    done
}

for stage in "${stages[@]}"; do
    case $stage in
    tests)
        timed tests "${TEST_TIMEOUT:-200}" python3 -m pytest -q -n 8 -p no:cacheprovider -rfE \
            tests/test_decode_hopper.py tests/test_decode_hopper_compile.py tests/test_triton_backend.py \
            tests/test_decode_loop_gpu.py tests/test_prefill_hopper.py tests/test_graph_dequant_prefill.py \
            tests/test_value_runs.py tests/test_rotary_boundary.py tests/test_value_layout.py tests/test_int8_kernels.py \
            tests/test_kv_rotation.py tests/test_key_centring.py tests/test_dequantize_blocks.py
        ;;
    decode)
        timed decode "${DECODE_TIMEOUT:-280}" python3 benchmarks/bench_decode.py --hopper-wgmma \
            --variants "hopper wgmma" --rep-ms 30 --budget-s 200 \
            --shapes "${DECODE_SHAPES:-32x512,64x4096,128x2048,16x16384,lognormal64(med=2048}" \
            --out "$out/decode-hopper.json"
        ;;
    e2e)
        for form in "bf16-triton --hopper-decode never" "bf16-hopper" "fp8-hopper --hopper-decode --kv-cache-dtype float8_e4m3" \
            "fp8-triton --kv-cache-dtype float8_e4m3"; do
            read -r name args <<<"$form"
            # shellcheck disable=SC2086  # args are words
            timed "e2e-$name" "${E2E_TIMEOUT:-150}" python3 benchmarks/bench_e2e.py --skip-transformers \
                --workloads burst $args --out "$out/e2e-$name.json"
        done
        ;;
    mla)
        timed mla "${MLA_TIMEOUT:-200}" python3 benchmarks/bench_mla_decode.py --plan-only \
            --batches 64x4096,lognormal-128 --rep-ms 40 --out "$out/mla-decode.json"
        ;;
    burst)
        timed burst "${DECODE_TIMEOUT:-280}" python3 benchmarks/bench_decode.py --fp8-sweep --hopper-wgmma \
            --shapes "lognormal128(med=550" --rep-ms 30 --budget-s 200 --out "$out/decode-burst.json"
        ;;
    burst-e2e)
        e2e=(python3 benchmarks/bench_e2e.py --skip-transformers --workloads "${E2E_WORKLOADS:-burst}")
        timed e2e-bf16 "${E2E_TIMEOUT:-150}" "${e2e[@]}" --out "$out/e2e-bf16.json"
        timed e2e-fp8 "${E2E_TIMEOUT:-150}" "${e2e[@]}" --kv-cache-dtype float8_e4m3 --out "$out/e2e-fp8.json"
        IFS=';' read -r -a launches <<<"${E2E_LAUNCHES-fp8 n128 w4 s3 p3;fp8 n128 w4 s2 p3}"
        for launch in "${launches[@]}"; do
            read -r cache words <<<"$launch"
            [ -n "$words" ] || continue
            dtype=()
            [ "$cache" = fp8 ] && dtype=(--kv-cache-dtype float8_e4m3)
            name="e2e-$cache-${words// /-}"
            timed "$name" "${E2E_TIMEOUT:-150}" "${e2e[@]}" "${dtype[@]}" --decode-launch "$words" \
                --out "$out/$name.json"
        done
        ;;
    direct-e2e)
        # The burst and the Poisson run, each cache with one graph a bucket, then two (the
        # default); the first run of a cache compiles its kernels, so the fp8 single-graph run
        # is repeated last (burst only) for a capture time with the same warm compile cache.
        e2e=(python3 benchmarks/bench_e2e.py --skip-transformers --workloads burst,poisson)
        for cache in fp8 bf16; do
            dtype=()
            [ "$cache" = fp8 ] && dtype=(--kv-cache-dtype float8_e4m3)
            timed "e2e-$cache-combine" "${E2E_TIMEOUT:-150}" "${e2e[@]}" "${dtype[@]}" --no-direct-decode-graphs \
                --out "$out/e2e-$cache-combine.json"
            timed "e2e-$cache-direct" "${E2E_TIMEOUT:-150}" "${e2e[@]}" "${dtype[@]}" --out "$out/e2e-$cache-direct.json"
        done
        timed e2e-fp8-combine-warm "${E2E_TIMEOUT:-150}" python3 benchmarks/bench_e2e.py --skip-transformers \
            --workloads burst --kv-cache-dtype float8_e4m3 --no-direct-decode-graphs --out "$out/e2e-fp8-combine-warm.json"
        ;;
    short-blocks-e2e)
        # fp8 at block 32, burst and Poisson: the Triton launch against the Gluon kernel (the
        # default, TritonBackend(hopper_decode=None)).
        e2e=(python3 benchmarks/bench_e2e.py --skip-transformers --workloads burst,poisson --block-size 32
            --kv-cache-dtype float8_e4m3)
        timed e2e-fp8-b32-triton "${E2E_TIMEOUT:-150}" "${e2e[@]}" --hopper-decode never \
            --out "$out/e2e-fp8-b32-triton.json"
        timed e2e-fp8-b32-hopper "${E2E_TIMEOUT:-150}" "${e2e[@]}" --out "$out/e2e-fp8-b32-hopper.json"
        ;;
    dequant-e2e)
        # The Poisson run (mixed graph steps) over fp8 and int8 caches: prefill rows of graph
        # steps on the Triton kernel (the default) against the Hopper kernel over a 16-bit copy.
        poisson_8bit_pair triton-prefill dequant-prefill --graph-dequant-prefill
        ;;
    value-runs-e2e)
        # Prefill rows' token-major V in coalesced runs (the default; int8 takes none unless
        # forced) against token by token.
        poisson_8bit_pair value-runs token-by-token --no-value-runs
        ;;
    stall-e2e)
        # The fp8 burst on the Triton and the Gluon decode kernel, each twice, alternating (the
        # first run of a process tree compiles what the Triton disk cache lacks; later ones load
        # it): each run prints the kernels compiled while serving and its slowest iterations.
        e2e=(python3 benchmarks/bench_e2e.py --skip-transformers --workloads burst --kv-cache-dtype float8_e4m3
            --block-size "${STALL_BLOCK:-256}")
        for run in triton-1 hopper-1 triton-2 hopper-2; do
            flag=(--hopper-decode never)
            [ "${run%-*}" = hopper ] && flag=(--hopper-decode always)
            timed "e2e-fp8-stall-$run" "${E2E_TIMEOUT:-150}" "${e2e[@]}" "${flag[@]}" \
                --out "$out/e2e-fp8-stall-$run.json"
        done
        ;;
    ratio-e2e)
        # The burst's decode attention over fp8 against bf16, runs alternating (issue 20's 0.6x)
        timed e2e-cache-ratio "${RATIO_TIMEOUT:-300}" python3 benchmarks/e2e_cache_ratio.py --pairs "${RATIO_PAIRS:-2}" \
            --out "$out/e2e-cache-ratio.json"
        ;;
    overlap)
        timed overlap-tests "${TEST_TIMEOUT:-120}" python3 -m pytest -q -n 8 -p no:cacheprovider -rfE \
            tests/test_decode_hopper.py tests/test_decode_hopper_compile.py
        timed overlap-decode "${DECODE_TIMEOUT:-200}" python3 benchmarks/bench_decode.py --hopper-wgmma \
            --variants "3 stages" --shapes "lognormal128(med=550,64x4096,32x512" --rep-ms 30 --budget-s 150 \
            --out "$out/decode-overlap.json"
        for loop in in-turn overlapped; do
            flags=(--hopper-decode always)
            [ $loop = overlapped ] && flags+=(--hopper-decode-overlap)
            timed "ratio-$loop" "${RATIO_TIMEOUT:-200}" python3 benchmarks/e2e_cache_ratio.py --pairs "${RATIO_PAIRS:-1}" \
                --out "$out/ratio-$loop.json" -- "${flags[@]}"
        done
        ;;
    suite)
        timed suite "${SUITE_TIMEOUT:-420}" python3 -m pytest -q -n 12 -p no:cacheprovider -rfE tests/
        ;;
    *)
        echo "unknown stage $stage (tests, decode, e2e, mla, burst, burst-e2e, direct-e2e, short-blocks-e2e, dequant-e2e," \
            "value-runs-e2e, stall-e2e, ratio-e2e, overlap, suite)" >&2
        exit 2
        ;;
    esac
done

files=$(cd "$out" && ls | grep -v '^round.tgz$')
# shellcheck disable=SC2086  # file names without spaces
[ -n "$files" ] && tar czf "$out/round.tgz" -C "$out" $files && (cd "$out" && rm -f $files)
echo
echo "== summary"
printf '%s\n' "${summary[@]}"
tar xzf "$out/round.tgz" -O --wildcards 'tests.log' 'suite.log' 2>/dev/null | grep -E "passed|failed" | tail -2
for log in $(tar tzf "$out/round.tgz" 2>/dev/null | grep '^e2e-.*\.log$'); do
    tar xzf "$out/round.tgz" -O "$log" | grep -E "^  ours:|^  profile:" | sed "s/^/$log:/"
done

#!/usr/bin/env bash
# The one GPU check of the CUDA platform (docs/gpu.md says what it must print).
#
#   tools/gpu-check.sh prepare   # here, on a machine with Rust: builds what the GPU machine runs
#                                # into gpu-carry/ (release binaries, stripped; ~20 MB)
#   tools/gpu-check.sh run       # on the GPU machine (no Rust there): the NVRTC compile test,
#                                # the golden tests on the device, the 14B bench, and the
#                                # PyTorch/transformers side-by-side; everything to $OUT/log
#
# With the device tool: run `prepare` here, then
#   run(command="bash tools/gpu-check.sh run", carry=["gpu-carry"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=gpu-carry

prepare() {
    set -e
    rm -rf "$CARRY"
    mkdir -p "$CARRY"
    export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols
    cargo build --release -p simpler-cli --features cuda
    cp target/release/simpler "$CARRY/simpler"
    # The test executables, by name, from cargo's build messages.
    cargo test --release -p simpler-cuda --features cuda --no-run --message-format=json \
        | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["target"]["kind"] == ["test"]:
        shutil.copy(exe, sys.argv[1] + "/test-" + m["target"]["name"])
' "$CARRY"
    ls -la "$CARRY"
    du -sh "$CARRY"
}

# Runs one step, logs it, and records its status without stopping the others.
STATUS=()
step() {
    local name=$1
    shift
    echo "== $name" | tee -a "$LOG"
    local t0=$SECONDS
    "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
    STATUS+=("$name: exit $rc")
    [ "$rc" -eq 0 ] || FAILED=1
}

run() {
    OUT=${OUT:-/tmp/gpu-check-out}
    mkdir -p "$OUT"
    LOG=$OUT/log
    : >"$LOG"
    FAILED=0
    for f in simpler test-nvrtc test-device test-graph_plan; do
        [ -x "$CARRY/$f" ] || { echo "missing $CARRY/$f: run 'tools/gpu-check.sh prepare' and carry $CARRY" | tee -a "$LOG"; exit 2; }
    done
    # libnvrtc.so.13: the CUDA toolkit's, else the pip package beside PyTorch.
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        "$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null)"; do
        if [ -n "$d" ] && ls "$d"/libnvrtc.so.13* >/dev/null 2>&1; then
            export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            echo "libnvrtc from $d" | tee -a "$LOG"
            break
        fi
    done
    # A fresh kernel cache: the first process compiles, every later one loads from it.
    export SIMPLER_KERNEL_CACHE=/tmp/simpler-kernel-cache
    rm -rf "$SIMPLER_KERNEL_CACHE"
    export SIMPLER_REQUIRE_NVRTC=1 SIMPLER_REQUIRE_CUDA=1 RUST_BACKTRACE=1 PYTHONUNBUFFERED=1
    step "device" nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
    step "nvrtc: every module for sm_90" timeout 120 "$CARRY/test-nvrtc" --test-threads 1 --nocapture
    step "golden: decode steps on the device vs the fp32 golden" timeout 180 "$CARRY/test-device" --test-threads 1 --nocapture
    step "captured task graph -> CUDA graph" timeout 120 "$CARRY/test-graph_plan" --test-threads 1 --nocapture
    step "bench: simpler, Qwen3-14B decode" timeout 240 "$CARRY/simpler" bench qwen3-decode \
        --platform cuda --preset qwen3-14b --shapes 1x512,16x3500 --warmup 3 --rounds 20
    # GPU_CHECK_SKIP_HF=1 leaves the peer out (a rerun after a change to simpler alone).
    if [ "${GPU_CHECK_SKIP_HF:-0}" != 1 ]; then
        step "bench: PyTorch/transformers, same shapes" timeout 240 python3 tools/hf_qwen3_decode.py \
            --shapes 1x512,16x3500 --warmup 3 --rounds 20
    fi
    # GPU_CHECK_NCU=1: Nsight Compute on the first tensor-core GEMV and attention launches of
    # the 16x3500 step (throughput, occupancy, stall reasons) into $OUT/ncu.txt.
    if [ "${GPU_CHECK_NCU:-0}" = 1 ]; then
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        step "ncu: GEMV and attention at 16x3500" timeout 240 "$NCU" --clock-control none \
            --kernel-name regex:'gemv_bf16_mma$|attn_decode_partial_mma' --launch-count 5 \
            --section SpeedOfLight --section Occupancy --section WarpStateStats \
            --section MemoryWorkloadAnalysis --section LaunchStats \
            --log-file "$OUT/ncu.txt" "$CARRY/simpler" bench qwen3-decode --platform cuda \
            --preset qwen3-14b --shapes 16x3500 --warmup 0 --rounds 1
    fi
    echo "== summary" | tee -a "$LOG"
    printf '%s\n' "${STATUS[@]}" | tee -a "$LOG"
    grep -E '^\| |^kernels: |^read bandwidth|^hf |^profile |^[0-9]+x[0-9]+ ' "$LOG" | tee "$OUT/summary"
    exit "$FAILED"
}

case "${1:-}" in
prepare) prepare ;;
run) run ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac

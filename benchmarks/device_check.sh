#!/usr/bin/env bash
# The checks the CPU suite cannot make, in one run on a machine with a CUDA or ROCm GPU:
#   1. the accelerator tests (vendor kernels against the portable ones, torchao's FP8/MXFP8 kernels where
#      torchao is installed, CUDA timers, and the pinned initial-weights draw under the machine's torch),
#   2. `ferry kernels bench` in bfloat16 (the ledger's missing measured gains),
#   3. the rehearsal of a GPU-to-CPU move (`ferry rehearse start` on the GPU, `finish` on the CPU):
#      trained on the GPU, resumed on the CPU from its checkpoint and trained there from scratch,
#      judged against the GPU run; the verdict goes to $out/portability with its lead time,
#   4. whole training steps (benchmarks/accelerator_training.py): every variant (portable, vendor kernels,
#      compiled blocks, activation checkpointing, the micro-batch ferry's memory model picks, FP8 emulated /
#      native / torchao) on the mid-size shape; then the OLMoE-1B-7B shape (one 4,096-token sequence a
#      micro-batch, 8 a step, unless the variant lets ferry pick the micro-batch) in two stages:
#        olmoe (the acceptance): auto, compiled, large-micro, large-micro-eager, with large-micro's step
#          traced and summarised (GPU busy share, top kernels, GEMM share of GPU time); it needs MFU >= 40%
#          compiled and >= 30% eager at the micro-batch the memory model picks, and a GEMM share >= 60%;
#        olmoe_extra: large-micro again, fp8-torchao-compiled, checkpointed, fp8-native (the torchao
#          variant fails fast, and says so, without torchao): FP8's approval figure,
#          fp8_torchao_compiled_vs_large_micro (>= 1.1 to approve), comes from this one stage;
#      and the standard suites (`ferry bench moe-tiny` on the GPU, `ferry bench olmoe-1b-7b`) with their cost,
#   5. checkpoint save and load throughput on the machine's disk.
# Usage: bash benchmarks/device_check.sh [STAGE...]   (writes under $OUT, default runs/device-check)
# STAGE: tests olmoe olmoe_extra training kernels rehearse suites io (default: all, in that order; each
# prints its time). All of them take longer than one 10-minute device call: run them in groups that fit,
# the acceptance first. Estimates, not measurements: an OLMoE-1B-7B variant costs 30-60 s of setup, about
# a minute more to compile when compiled, and ~1 s a step; so the OLMoE stages run 10 steps (5 of warm-up,
# the traced step left out of the medians), not 12, and each stays one call: `olmoe` ~6-7 min (2 eager,
# 2 compiled, a trace to write and read), `olmoe_extra` ~7-8 min (3 compiled, 1 eager), each on its own;
# then `training` (12 variants of the mid shape, half of them compiled); then `tests kernels`, then
# `rehearse suites io`.
# Needs ferry's dependencies importable next to the GPU build of torch; it says which are not.
set -u -o pipefail
out="${OUT:-runs/device-check}"
mkdir -p "$out"
python="${PYTHON:-python}"
ferry() { "$python" -m ferry "$@"; }

"$python" - <<'PY' || exit 2
import importlib, sys
missing = [m for m in ("torch", "numpy", "yaml", "pydantic", "rich", "tokenizers", "safetensors", "xxhash",
                       "prometheus_client", "matplotlib", "markdown", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"device check: missing packages: {', '.join(missing)}")
import torch
if not torch.cuda.is_available():
    sys.exit("device check: no CUDA or ROCm device visible to torch")
print(f"device check: {torch.cuda.get_device_name()} torch {torch.__version__}")
PY

data="$out/data"
prepare_data() {
    [ -f "$data/manifest.json" ] || ferry data prepare --embedded stdlib --output "$data" --max-bytes 2000000
}

stage_tests() {
    "$python" -m pytest -q -rs tests/test_kernels_agreement.py tests/test_kernels_low_precision.py \
        tests/test_kernels_torchao.py tests/test_moe_host_syncs.py tests/test_metrics_step.py tests/test_head_loss.py \
        tests/test_initialisation.py tests/test_norm.py tests/test_cross_entropy.py 2>&1 \
        | tee "$out/accelerator_tests.txt"
}

stage_kernels() {
    ferry kernels bench --device cuda --dtype bfloat16 --history "$out/portability" 2>&1 | tee "$out/kernels_bench.txt"
}

stage_rehearse() {
    prepare_data || return 1
    rm -rf "$out/bundle" "$out/bundle-source" "$out/finish-cpu"
    ferry rehearse start configs/tiny.yaml "data.sources.0.path=$data" --from cuda --out "$out/bundle" \
        --steps 100 --switch-at 50 || return 1
    ferry rehearse finish "$out/bundle" --to cpu --dir "$out/finish-cpu" --history "$out/portability" 2>&1 \
        | tee "$out/rehearsal.txt" || return 1
    ferry report --history "$out/portability" --out "$out/report"
}

stage_training() {
    prepare_data || return 1
    "$python" benchmarks/accelerator_training.py --data "$data" 2>&1 | tee "$out/accelerator_training.txt"
}

# Each OLMoE-1B-7B variant is its own process; accelerator_training.py has the GPU draw its initial weights
# (run.init_device: run), where the host's draw (ferry's default, the same weights on any hardware) would take
# ~3.5 min a variant: it is serial, ~31 ns a parameter whatever the core count. `ferry bench olmoe-1b-7b`
# (stage suites) keeps the host's draw, its inputs being the suite's on every device. Two stages, the
# acceptance's first.
stage_olmoe() {
    prepare_data || return 1
    "$python" benchmarks/accelerator_training.py --data "$data" --shape olmoe-1b-7b --steps 10 \
        --variants auto,compiled,large-micro,large-micro-eager --trace large-micro 2>&1 \
        | tee "$out/accelerator_training-olmoe-1b-7b.txt"
}

stage_olmoe_extra() {
    prepare_data || return 1
    "$python" benchmarks/accelerator_training.py --data "$data" --shape olmoe-1b-7b --steps 10 \
        --variants large-micro,fp8-torchao-compiled,checkpointed,fp8-native 2>&1 \
        | tee "$out/accelerator_training-olmoe-1b-7b-extra.txt"
}

stage_suites() {
    rm -rf "$out"/bench-*
    local suite failed=0
    for suite in moe-tiny olmoe-1b-7b; do
        ferry bench "$suite" --device cuda --out "$out/bench-$suite.json" --dir "$out/bench-$suite" 2>&1 \
            | tee "$out/bench-$suite.txt" || failed=1
        ferry cost "$out/bench-$suite.json" --out "$out/bench-$suite-cost" 2>&1 | tee -a "$out/bench-$suite.txt" \
            || failed=1
    done
    return $failed
}

stage_io() {
    "$python" benchmarks/checkpoint_io.py --dir "$out" 2>&1 | tee "$out/checkpoint_io.txt"
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests olmoe olmoe_extra training kernels rehearse suites io)
status=0
for stage in "${stages[@]}"; do
    if ! declare -F "stage_$stage" > /dev/null; then
        echo "device check: no stage $stage (stages: tests olmoe olmoe_extra training kernels rehearse suites io)" >&2
        exit 2
    fi
    started=$SECONDS
    "stage_$stage" || { status=1; echo "device check: stage $stage failed" >&2; }
    echo "device check: stage $stage took $((SECONDS - started)) s"
done
exit $status

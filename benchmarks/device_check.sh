#!/usr/bin/env bash
# The checks the CPU suite cannot make, in one run on a machine with a CUDA or ROCm GPU:
#   1. the accelerator tests (vendor kernels against the portable ones, CUDA timers),
#   2. `ferry kernels bench` in bfloat16 (the ledger's missing measured gains),
#   3. the rehearsal of a GPU-to-CPU move (`ferry rehearse start` on the GPU, `finish` on the CPU):
#      trained on the GPU, resumed on the CPU from its checkpoint and trained there from scratch,
#      judged against the GPU run; the verdict goes to $out/portability with its lead time,
#   4. whole training steps with the vendor kernels against the portable path (bfloat16 and FP8),
#      and the standard suites (`ferry bench moe-tiny` on the GPU, `ferry bench olmoe-1b-7b`) with their cost,
#   5. checkpoint save and load throughput on the machine's disk.
# Usage: bash benchmarks/device_check.sh   (writes under $OUT, default runs/device-check)
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

status=0
"$python" -m pytest -q -rs tests/test_kernels_agreement.py tests/test_kernels_low_precision.py \
    tests/test_metrics_step.py 2>&1 | tee "$out/accelerator_tests.txt" || status=1
ferry kernels bench --device cuda --dtype bfloat16 --history "$out/portability" 2>&1 | tee "$out/kernels_bench.txt" \
    || status=1

data="$out/data"
ferry data prepare --embedded stdlib --output "$data" --max-bytes 2000000 || exit 1
rm -rf "$out/bundle" "$out/bundle-source" "$out/finish-cpu"
ferry rehearse start configs/tiny.yaml "data.sources.0.path=$data" --from cuda --out "$out/bundle" \
    --steps 100 --switch-at 50 || exit 1
ferry rehearse finish "$out/bundle" --to cpu --dir "$out/finish-cpu" --history "$out/portability" 2>&1 \
    | tee "$out/rehearsal.txt" || status=1
ferry report --history "$out/portability" --out "$out/report" || status=1
"$python" benchmarks/accelerator_training.py --data "$data" 2>&1 | tee "$out/accelerator_training.txt" || status=1
rm -rf "$out"/bench-*
for suite in moe-tiny olmoe-1b-7b; do
    ferry bench "$suite" --device cuda --out "$out/bench-$suite.json" --dir "$out/bench-$suite" 2>&1 \
        | tee "$out/bench-$suite.txt" || status=1
    ferry cost "$out/bench-$suite.json" --out "$out/bench-$suite-cost" 2>&1 | tee -a "$out/bench-$suite.txt" || status=1
done
"$python" benchmarks/checkpoint_io.py --dir "$out" 2>&1 | tee "$out/checkpoint_io.txt" || status=1
exit $status

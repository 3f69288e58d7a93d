"""benchmarks/trace_summary.py on a synthetic chrome trace whose figures are known by construction: the device
check prints these figures instead of shipping the trace, so a miscount would only show as a wrong conclusion."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "trace_summary.py"

GEMM = (
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>"
    "(cutlass_80_wmma::Params)"
)
FLASH = "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4>, true>(Flash_fwd_params)"
MUL = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
    "at::native::binary_internal::MulFunctor<float> >, at::detail::Array<char*, 3> >(int, "
    "at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> >, "
    "at::detail::Array<char*, 3>)"
)
ADAM = (
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>(int)"
)
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
SORT = "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<int, float>(int*, float*)"
SCATTER = "void at::native::_scatter_gather_elementwise_kernel<128, 8>(int)"


def _kernel(name: str, ts: float, dur: float, stream: int = 7, cat: str = "kernel") -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 0,
        "tid": stream,
        "ts": ts,
        "dur": dur,
        "args": {"stream": stream},
    }


# times in microseconds from 1,000: the window is [1000, 2000] (the host span), the GPU events:
#   gemm   1000-1300 and 1250-1450 (stream 9: overlaps the first by 50), 1600-1700      -> 600 summed
#   flash  1450-1550                                                                    -> 100
#   mul    1500-1520 (inside flash's interval), 1700-1740                               -> 60
#   adam   1800-1880                                                                    -> 80
#   nccl   1880-1920                                                                    -> 40
#   sort   1920-1930                                                                    -> 10
#   memcpy 1950-1960                                                                    -> 10
# summed 900; union: 1000-1550 (550) + 1600-1740 (140) + 1800-1930 (130) + 1950-1960 (10) = 830
EVENTS = [
    {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "x", "ts": 1000, "dur": 1000},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1001, "dur": 5},
    {"ph": "i", "cat": "cpu_instant_event", "name": "marker", "pid": 1, "tid": 1, "ts": 5000},
    {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
    _kernel(GEMM, 1000, 300),
    _kernel(GEMM, 1250, 200, stream=9),
    _kernel(FLASH, 1450, 100),
    _kernel(MUL, 1500, 20, stream=9),
    _kernel(GEMM, 1600, 100),
    _kernel(MUL, 1700, 40),
    _kernel(ADAM, 1800, 80),
    _kernel(NCCL, 1880, 40, stream=20),
    _kernel(SORT, 1920, 10),
    _kernel("Memcpy DtoH (Device -> Pinned)", 1950, 10, cat="gpu_memcpy"),
]


@pytest.fixture(scope="module")
def trace_summary():
    spec = importlib.util.spec_from_file_location("trace_summary", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def trace(tmp_path) -> Path:
    path = tmp_path / "rank0-steps-6-6.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": EVENTS}))
    return path


def test_totals_count_overlapping_kernels_once_in_the_busy_share(trace_summary, trace):
    summary = trace_summary.summarise(trace)
    assert summary["window_ms"] == pytest.approx(1.0)
    assert summary["gpu_span_ms"] == pytest.approx(0.96)
    assert summary["gpu_ms"] == pytest.approx(0.9)
    assert summary["busy_ms"] == pytest.approx(0.83)
    assert summary["busy_share"] == pytest.approx(0.83)
    assert summary["launches"] == 10


def test_classes_share_the_summed_gpu_time(trace_summary, trace):
    classes = trace_summary.summarise(trace)["classes"]
    shares = {name: figures["share"] for name, figures in classes.items()}
    assert shares == pytest.approx(
        {
            "gemm": 600 / 900,
            "attention": 100 / 900,
            "elementwise": 60 / 900,
            "optimizer": 80 / 900,
            "collectives": 40 / 900,
            "memcpy": 10 / 900,
            "memset": 0.0,
            "other": 10 / 900,
        }
    )
    assert classes["gemm"]["launches"] == 3 and classes["gemm"]["ms"] == pytest.approx(0.6)


def test_top_kernels_are_ordered_by_time_with_short_names(trace_summary, trace):
    top = trace_summary.summarise(trace, top=3)["top"]
    assert [kernel["name"] for kernel in top] == [
        "Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>",
        "flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4>, true>",
        "multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor<float, 4>>",
    ]
    assert [kernel["launches"] for kernel in top] == [3, 1, 1]
    assert top[0]["ms"] == pytest.approx(0.6) and top[0]["share"] == pytest.approx(600 / 900)
    assert trace_summary.short_name(MUL) == (
        "vectorized_elementwise_kernel<4, BinaryFunctor<float, float, float, MulFunctor<float>>, Array<char*, 3>>"
    )


@pytest.mark.parametrize(
    ("name", "label"),
    [
        (SCATTER, "elementwise"),
        ("triton_poi_fused_add_mul_0", "elementwise"),
        ("triton_red_fused_rms_norm_3", "elementwise"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, 4>(int)", "elementwise"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
        ("Cijk_Alik_Bljk_BBS_BH_MT128x128x64_MI16x16x16x1", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
        ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(int)", "other"),
    ],
)
def test_kernel_names_fall_in_their_class(trace_summary, name, label):
    assert trace_summary.kernel_class(name) == label


def test_describe_prints_the_figures_and_a_gzipped_trace_reads_alike(trace_summary, trace, tmp_path):
    zipped = tmp_path / "trace.json.gz"
    zipped.write_bytes(gzip.compress(trace.read_bytes()))
    summary = trace_summary.summarise(zipped)
    assert summary["busy_ms"] == pytest.approx(0.83)
    text = trace_summary.describe(summary)
    assert "GPU busy 0.8 ms (83.0%)" in text and "gemm 66.7%" in text and "Kernel2<cutlass_80" in text


def test_a_missing_file_or_not_a_trace_exits_2_naming_the_file(tmp_path):
    not_a_trace = tmp_path / "metrics.jsonl"
    not_a_trace.write_text('{"step": 1}\n{"step": 2}\n')
    wrong_shape = tmp_path / "run.json"
    wrong_shape.write_text('{"config": {}}')
    for path in (tmp_path / "absent.json", not_a_trace, wrong_shape):
        result = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
        assert result.returncode == 2, result.stderr
        assert str(path) in result.stderr and "Traceback" not in result.stderr

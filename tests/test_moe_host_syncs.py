"""A training step's MoE path keeps token counts, offsets and the permutation on the device.

On an accelerator every read of a tensor's value on the host (`.item()`, `.tolist()`, `bool(t)`,
an op whose output size depends on the data) stalls the host until the device catches up. With all
experts local and the grouped GEMM taking device offsets (what `auto` selects on an SM90 GPU), a
forward and backward of the model makes no such read. On a CPU the same code path runs with
`torch_grouped_mm@cpu` in place of the CUDA kernel, and a dispatch mode records every op that
would read a value on the host. On a GPU, torch's own sync detector checks the real thing.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ferry.kernels import KernelsConfig, select_kernels
from ferry.kernels.dispatch import host_reads
from ferry.model import ModelConfig, Transformer

# The aten ops that hand a tensor's value to the host (`.item()`, `int(t)`, `bool(t)` all dispatch
# `_local_scalar_dense`), or whose output size depends on tensor values (so the host must read them).
SYNCING_OPS = {
    "aten._local_scalar_dense",
    "aten.equal",
    "aten.bincount",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
}


class RecordHostReads(TorchDispatchMode):
    """Records every host read while it is active, forward and backward (a dispatch mode reaches the ops
    autograd runs for custom functions' backwards too): the syncing aten ops, `repeat_interleave` without
    its output size, and `.tolist()` / `.numpy()`, which read a CPU tensor's memory without an op."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self._patched = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        sized_on_the_host = (
            name == "aten.repeat_interleave"
            and kwargs.get("output_size") is None
            and any(isinstance(arg, torch.Tensor) and arg.dtype in (torch.int32, torch.int64) for arg in args)
        )
        if name in SYNCING_OPS or sized_on_the_host:
            self.reads.append(name)
        return func(*args, **kwargs)

    def __enter__(self):
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)
            self._patched[method] = original

            def reading(tensor, *args, _original=original, _method=method, **kwargs):
                self.reads.append(f"Tensor.{_method}")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, reading)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._patched.items():
            setattr(torch.Tensor, method, original)
        return super().__exit__(*exc)


def _model(kernels, **moe):
    config = ModelConfig.model_validate(
        {
            "vocab_size": 64,
            "dim": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "max_seq_len": 16,
            "dense_layers": 0,
            "qk_norm": True,
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 16, **moe},
        }
    )
    torch.manual_seed(0)
    return Transformer(config, kernels)


def _step(model, device) -> None:
    tokens_BS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    output = model(tokens_BS)
    loss = output.logits_BSV.float().logsumexp(-1).mean() + sum(stats.aux_loss for stats in output.moe_stats)
    loss.backward()


def _device_offsets_kernels(device: str):
    """What `auto` takes on an SM90 GPU for local experts: the portable routed path on torch's grouped GEMM."""
    return select_kernels(KernelsConfig(policy="portable", ops={"moe.grouped_mm": "torch_grouped_mm"}), device)


def test_the_local_experts_path_reads_nothing_on_the_host():
    kernels = _device_offsets_kernels("cpu")
    assert not host_reads(kernels["moe.grouped_mm"])
    model = _model(kernels, bias_balancing={"enabled": True})
    with RecordHostReads() as recorder:
        _step(model, "cpu")
    assert recorder.reads == []
    assert all(p.grad is not None for p in model.parameters())


def test_the_recorder_sees_the_host_reads_of_a_looping_grouped_gemm():
    """The control: the portable per-expert loop reads its group sizes on the host, once per GEMM call."""
    kernels = select_kernels(KernelsConfig(policy="portable"), "cpu")
    assert host_reads(kernels["moe.grouped_mm"])
    model = _model(kernels)
    with RecordHostReads() as recorder:
        _step(model, "cpu")
    assert recorder.reads == ["Tensor.tolist"] * (2 * 3)  # 2 MoE layers x 3 GEMMs (the backward reuses them)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_moe_layers_forward_and_backward_never_wait_for_the_gpu():
    """The MoE layer alone: the embedding's CUDA backward and the loss's read-out are not the MoE path."""
    kernels = select_kernels(KernelsConfig(policy="auto"), "cuda", torch.bfloat16)
    if kernels.choices["moe.grouped_mm"].implementation.portable:
        pytest.skip(f"no device grouped GEMM here: {kernels.choices['moe.grouped_mm'].reason}")
    layer = _model(kernels, bias_balancing={"enabled": True}).moe_layers()[0].to("cuda", torch.bfloat16)
    x_BSD = torch.randn(2, 16, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def forward_and_backward():
        out_BSD, stats = layer(x_BSD)
        (out_BSD.float().square().mean() + stats.aux_loss + stats.z_loss).backward()
        layer.router.update_bias(stats.tokens_per_expert_E)

    forward_and_backward()  # first calls set things up (cuBLAS handles, lazy inits), which may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward_and_backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_native_fp8_path_reads_nothing_on_the_host():
    """`torch_scaled_grouped_mm`'s quantisation and padding around a kernel that only gives shapes (the real
    kernel runs on a GPU; its numerics are checked against a reference in test_kernels_low_precision.py)."""
    from ferry.kernels.vendor.torch_scaled_grouped_mm import CUDA_ELEMENTS, scaled_grouped_mm_with
    from ferry.precision.formats import float_format
    from ferry.precision.recipe import LowPrecisionRecipe

    def shapes_only(a, b, scale_a, scale_b, offs, out_dtype):
        if b.ndim == 3:  # 2d x 3d: a row per token
            return torch.zeros(a.shape[0], b.shape[2], dtype=out_dtype)
        return torch.zeros(offs.shape[0], a.shape[0], b.shape[1], dtype=out_dtype)  # 2d x 2d: a matrix per group

    e4m3 = float_format("float8_e4m3fn")
    x_NI = torch.randn(40, 32, requires_grad=True)
    w_EOI = torch.randn(4, 16, 32, requires_grad=True)
    offsets_E = torch.tensor([5, 5, 29, 40], dtype=torch.int32)
    with RecordHostReads() as recorder:
        y_NO = scaled_grouped_mm_with(
            shapes_only, CUDA_ELEMENTS, x_NI, w_EOI, offsets_E, LowPrecisionRecipe("fp8", e4m3, e4m3)
        )
        y_NO.sum().backward()
    assert recorder.reads == []
    assert x_NI.grad is not None and w_EOI.grad is not None

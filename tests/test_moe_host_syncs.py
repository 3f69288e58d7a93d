"""A training step's MoE path keeps token counts, offsets and the permutation on the device.

On an accelerator every read of a tensor's value on the host (`.item()`, `.tolist()`, `bool(t)`,
an op whose output size depends on the data) stalls the host until the device catches up. With all
experts local and the grouped GEMM taking device offsets (what `auto` selects on an SM90 GPU), a
forward and backward of the model makes no such read. On a CPU the same code path runs with
`torch_grouped_mm@cpu` in place of the CUDA kernel, and a function mode records every call that
would read a value on the host. On a GPU, torch's own sync detector checks the real thing.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ferry.kernels import KernelsConfig, select_kernels
from ferry.kernels.dispatch import host_reads
from ferry.model import ModelConfig

# Every Python-level call that hands a tensor's value to the host, and the ops whose output size depends
# on tensor values (so the host must read them to allocate the output).
HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.equal,
    torch.bincount,
    torch.Tensor.bincount,
    torch.nonzero,
    torch.Tensor.nonzero,
    torch.unique,
    torch.masked_select,
    torch.Tensor.masked_select,
}


class RecordHostReads(TorchFunctionMode):
    """Records the host reads among the torch functions called while it is active (autograd's backward
    functions included: they run under the same mode on the calling thread)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sized_without_output_size = func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and (
            "output_size" not in kwargs and isinstance(args[1] if len(args) > 1 else None, torch.Tensor)
        )
        if func in HOST_READS or sized_without_output_size:
            self.reads.append(getattr(func, "__qualname__", str(func)))
        return func(*args, **kwargs)


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
    return config.build(kernels)


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
    assert recorder.reads == ["TensorBase.tolist"] * (2 * 3)  # 2 MoE layers x 3 GEMMs (the backward reuses them)


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

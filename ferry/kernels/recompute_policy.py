"""Which aten ops a recomputed block keeps instead of running again (`train.activation_checkpointing`).

The policies `ferry/model/recompute.py` hands to `torch.utils.checkpoint`'s selective checkpointing, here because
they name the kernels the ops dispatch to. Both keep what a recompute must not decide, wait for or send again: the
router's top-k choice, host reads and device-to-host copies, and the expert-parallel exchange (its collectives and
the `aten.alias` of the rows they received). `selective` also keeps the outputs of the GEMMs and of the attention
kernels. An op that writes into a tensor it was handed (`out=`, in place) is never kept: later writes to that
tensor would change the kept copy, so it runs again (a kernel that fills one output by slices, like the portable
grouped GEMM, is recomputed whole).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy

aten = torch.ops.aten

# kept by every policy: what a recompute must not decide, wait for or send again
_KEPT_ALWAYS = {
    aten.topk,  # the routing choice
    aten._local_scalar_dense,  # `.item()` on the host
    aten.alias,  # the rows an expert-parallel all-to-all received (`Collectives.all_to_all_raw`)
}
# kept by `selective`: the GEMMs and the attention kernels
_KEPT_SELECTIVE = {
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.baddbmm,
    aten._grouped_mm,
    aten._scaled_mm,
    aten._scaled_grouped_mm,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._flash_attention_forward,
    aten._efficient_attention_forward,
}


def _kept(selective: bool, context, func, *args, **kwargs) -> CheckpointPolicy:
    packet = func.overloadpacket
    if func._schema.is_mutable and func.namespace != "c10d":
        # an op writing into a tensor it was handed (`out=`, in place): what it wrote is that tensor's, whose later
        # writes would change a kept copy; it runs again
        return CheckpointPolicy.PREFER_RECOMPUTE
    if packet in _KEPT_ALWAYS or func.namespace == "c10d" or _to_host(packet, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    if selective and packet in _KEPT_SELECTIVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _to_host(packet, args, kwargs) -> bool:
    """A copy from an accelerator to the host (`.tolist()`, `.cpu()`): a device sync the recompute need not repeat."""
    if packet is not aten._to_copy or not args or not isinstance(args[0], torch.Tensor):
        return False
    target = kwargs.get("device")
    return args[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu"


KEEP_POLICIES = {"full": partial(_kept, False), "selective": partial(_kept, True)}

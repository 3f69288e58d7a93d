"""MXFP4 expert weights, as GPT-OSS's released checkpoints hold them, dequantised on import.

OCP's microscaling FP4: each run of 32 consecutive values along a row (the input dimension) shares one E8M0
scale, a power of two stored as its biased exponent (127 = 2^0); each value is an E2M1 number (sign, two
exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two to a byte, the lower
nibble first. A tensor `W` of `[E, rows, cols]` is stored as `W_blocks` (`[E, rows, cols / 32, 16]` bytes) and
`W_scales` (`[E, rows, cols / 32]`). Every value converts exactly to fp32, so the import is exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ferry.config import UserError
from ferry.interop.weights import read_safetensors

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(hf_config) -> bool:
    """Whether a transformers config says its checkpoint stores tensors in MXFP4."""
    quantization = getattr(hf_config, "quantization_config", None) or {}
    if isinstance(quantization, dict):
        return str(quantization.get("quant_method")) == "mxfp4"
    return str(getattr(quantization, "quant_method", None)) == "mxfp4"


def dequantize(blocks_ERGB: torch.Tensor, scales_ERG: torch.Tensor) -> torch.Tensor:
    """`[E, rows, groups, 16]` bytes and `[E, rows, groups]` exponents -> `[E, rows, groups * 32]` fp32."""
    if blocks_ERGB.shape[:-1] != scales_ERG.shape or blocks_ERGB.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks_ERGB.shape)} and scales {tuple(scales_ERG.shape)} do not pair "
            "(blocks: the scales' shape and 16 bytes)"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    packed = blocks_ERGB.to(torch.uint8).long()
    values_ERGB2 = torch.stack([table[packed & 0x0F], table[packed >> 4]], dim=-1)
    exponents_ERG11 = (scales_ERG.to(torch.int32) - SCALE_BIAS)[..., None, None]
    return torch.ldexp(values_ERGB2, exponents_ERG11).flatten(-3)


def read_mxfp4_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files in fp32, each MXFP4 pair dequantised under the name
    transformers gives the unquantised tensor, in its layout (`[E, in, out]`: the rows are the outputs)."""
    if not any(hf_dir.glob("*.safetensors")):
        raise UserError(f"{hf_dir}: its config says MXFP4, and ferry reads that from safetensors files; there are none")
    raw = read_safetensors(hf_dir)
    state = {}
    for name, tensor in raw.items():
        if name.endswith(SCALES):
            continue
        if not name.endswith(BLOCKS):
            state[name] = tensor.float()
            continue
        base = name.removesuffix(BLOCKS)
        if base + SCALES not in raw:
            raise UserError(f"{hf_dir}: {name} has no {base + SCALES} beside it")
        try:
            state[base] = dequantize(tensor, raw[base + SCALES]).transpose(1, 2).contiguous()
        except ValueError as exc:
            raise UserError(f"{hf_dir}: {base}: {exc}") from None
    return state

"""The bytes a step moves in proportion to the parameter count rather than to its tokens, counted op by op.

A step of few tokens per micro-batch on a large model can spend more time on its parameters than on its
GEMMs: casting weights to the compute dtype, casting their gradients back and adding them up. This mode
counts exactly that work, by op, whatever device it runs on, so a benchmark or a test can say how it grows
with the number of micro-batches:

- `weight_casts`: an op that changes the dtype of a tensor shaped like a weight (`_to_copy`, `copy_` across
  dtypes), forward or backward: the weight's cast and its gradient's;
- `gradient_adds`: an add whose output is shaped like a weight and lands in the parameter dtype: a
  gradient accumulated into `.grad` (autograd's own, or a fused one).

Bytes are those each op reads and writes. The weights are told apart from activations by shape (theirs, and
that of a module's projections side by side, as attention casts its query, key and value weights in one): a
test or benchmark picks a model whose weights' shapes no activation shares.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
_CASTS = {aten._to_copy, aten.copy_, aten.copy}
_ADDS = {aten.add, aten.add_}


class ParameterTraffic(TorchDispatchMode):
    """Counts, by kind, the bytes of parameter-proportional work done inside it (see the module)."""

    def __init__(self, model: torch.nn.Module, weight_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.shapes = {tuple(param.shape) for param in model.parameters() if param.dim() >= 2} | _side_by_side(model)
        self.weight_dtype = weight_dtype
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _CASTS or packet in _ADDS:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if tensors and isinstance(out, torch.Tensor) and tuple(out.shape) in self.shapes:
                kind = self._kind(packet, tensors, out)
                if kind is not None:
                    self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)
                    self.calls[kind] += 1
        return out

    def _kind(self, packet, tensors: list[torch.Tensor], out: torch.Tensor) -> str | None:
        if packet in _CASTS:
            return "weight_casts" if len({t.dtype for t in tensors}) > 1 else None
        return "gradient_adds" if out.dtype == self.weight_dtype else None


def _side_by_side(model: torch.nn.Module) -> set[tuple[int, ...]]:
    """The shapes of a module's consecutive 2-D child weights of one input width, stacked (attention's query, key
    and value weights, cast in one): one cast covers them."""
    shapes = set()
    for module in model.modules():
        weights = [getattr(child, "weight", None) for child in module.children()]
        weights = [w for w in weights if isinstance(w, torch.Tensor) and w.dim() == 2]
        for first in range(len(weights)):
            rows = 0
            for weight in weights[first:]:
                if weight.shape[1] != weights[first].shape[1]:
                    break
                rows += weight.shape[0]
                shapes.add((rows, weight.shape[1]))
    return shapes

"""What a forward keeps for its backward, counted on any device: the storages its ops made that are still alive.

A GPU's allocator can say how much memory a forward left allocated; a CPU has no such counter, and the
saved-tensor hooks autograd offers see neither what activation checkpointing stores its own way nor what a
kernel keeps on its context. Counting storages does: every op's output storage is noted with its size, and
those still referenced once the forward has returned are what the backward will read (and the forward's
outputs, which the caller leaves out by measuring a loss, a scalar). Views and in-place results share a
storage that existed before the op and are not counted again.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class KeptMemory(TorchDispatchMode):
    """Inside it, notes every storage an op makes; `kept_bytes()` sums those still alive."""

    def __init__(self):
        super().__init__()
        self._made: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_key(tensor) for tensor in tree_leaves((args, kwargs)) if isinstance(tensor, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or _key(tensor) in inputs:
                continue
            known = self._made.get(_key(tensor))
            if known is None or known[0]() is None:  # new, or made where a freed storage was
                storage = tensor.untyped_storage()
                self._made[_key(tensor)] = (weakref.ref(storage), storage.nbytes())
        return out

    def kept_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self._made.values() if ref() is not None)


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()

"""Which rank does the optimizer's work for which piece of a parameter list, when several ranks could.

ZeRO-1 gives each piece of optimizer state one owner among the ranks that replicate the parameters; Muon under
FSDP gives each matrix one rank that orthogonalises it. Both cut an ordered list of pieces into consecutive runs,
one per rank, at the points where the running size passes each rank's equal share: every rank computes the same
answer from the sizes alone, each rank's load is within one piece of the mean, so the ranks finish together, and
consecutive pieces of one parameter (experts of a stack) stay one slice on their owner.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


def owners_by_size(sizes: list[int], ranks: int) -> list[int]:
    """The owner of each piece: the rank whose equal share of the running total holds the piece's midpoint."""
    total = sum(sizes)
    owners, done = [], 0
    for size in sizes:
        owners.append(min(ranks - 1, int((2 * done + size) * ranks // (2 * total))) if total else 0)
        done += size
    return owners


@dataclass(frozen=True)
class ParamSlice:
    """Rows [start, stop) of parameter `name`'s first dimension: the whole of a matrix or vector, a run of the
    experts of a stack (its matrices are its rows). `tensor` is the parameter itself when whole, else a parameter
    viewing the same storage, which the owner's optimizer steps and keeps state for."""

    name: str
    param: nn.Parameter
    start: int
    stop: int
    tensor: nn.Parameter

    @property
    def whole(self) -> bool:
        return self.tensor is self.param

    def take_gradient(self) -> None:
        """Point the slice's gradient at its rows of the parameter's (a view: no copy)."""
        if not self.whole:
            grad = self.param.grad
            self.tensor.grad = None if grad is None else grad[self.start : self.stop]


def slices_by_owner(params: list[tuple[str, nn.Parameter]], ranks: int) -> list[list[ParamSlice]]:
    """Each rank's slices of `params`: a stack of matrices (three or more dimensions) is split by matrix, anything
    else kept whole."""
    pieces = [
        (name, param, row) for name, param in params for row in (range(param.shape[0]) if param.ndim >= 3 else [None])
    ]
    sizes = [param.numel() if row is None else param[0].numel() for _, param, row in pieces]
    runs: list[list[list]] = [[] for _ in range(ranks)]
    for (name, param, row), owner in zip(pieces, owners_by_size(sizes, ranks), strict=True):
        mine = runs[owner]
        if row is not None and mine and mine[-1][0] == name and mine[-1][3] == row:
            mine[-1][3] = row + 1
        else:
            mine.append([name, param, 0 if row is None else row, param.shape[0] if row is None else row + 1])
    return [[_slice(*run) for run in owned] for owned in runs]


def _slice(name: str, param: nn.Parameter, start: int, stop: int) -> ParamSlice:
    if param.ndim < 3 or (start, stop) == (0, param.shape[0]):
        return ParamSlice(name, param, start, stop, param)
    return ParamSlice(name, param, start, stop, nn.Parameter(param.data[start:stop], requires_grad=param.requires_grad))

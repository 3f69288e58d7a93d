"""What a training step sums over its micro-batches and ranks: losses, correct predictions, the routers' loads,
probabilities and entropies per MoE layer, and the sums an objective names for itself.

They live in one flat float64 vector so that a single all-reduce makes them global; a preference or RL step sums
the same router statistics through the same vector, and its own sums (rewards, clipped tokens) by name in the
slots after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.model import ModelOutput, MoEStats


@dataclass
class LossParts:
    """A micro-batch's losses: `objective` is what backward runs on; the rest are detached parts for the
    metrics (an objective's `ForwardPass.loss` returns them, the step's sums add them up)."""

    objective: torch.Tensor
    lm_loss_sum: torch.Tensor
    correct: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor

    @classmethod
    def of_objective(cls, objective: torch.Tensor, aux_loss: torch.Tensor, z_loss: torch.Tensor) -> LossParts:
        """An objective with no token loss of its own in the step's sums (DPO, GRPO, a pipeline's filler), which
        keeps its figures in its own sums."""
        zero = torch.zeros((), dtype=objective.dtype, device=objective.device)
        return cls(objective, zero, zero, aux_loss.detach(), z_loss.detach())


class NamedSums:
    """Float64 sums addressed by name, over a slice of a vector that is reduced whole."""

    def __init__(self, names: tuple[str, ...], vector: torch.Tensor):
        if len(set(names)) != len(names):
            raise ValueError(f"a statistic is named twice in {names}")
        if vector.numel() != len(names):
            raise ValueError(f"{len(names)} names for {vector.numel()} slots")
        self.names = names
        self.vector = vector
        self._slot = {name: index for index, name in enumerate(names)}

    @classmethod
    def zeros(cls, names: tuple[str, ...], device: torch.device) -> NamedSums:
        return cls(names, torch.zeros(len(names), dtype=torch.float64, device=device))

    def add(self, **values: float | torch.Tensor) -> None:
        """Add each value to its named sum; an unknown name is a programming error, named."""
        for name, value in values.items():
            if name not in self._slot:
                raise KeyError(f"no statistic {name!r}; this step sums {', '.join(self.names)}")
            self.vector[self._slot[name]] += value

    def values(self) -> dict[str, float]:
        """Every sum by name (one copy off the device)."""
        return dict(zip(self.names, self.vector.tolist()))


class StepStatistics:
    """Sums over the micro-batches of this rank, then (after the plan's `sum_over_ranks(totals)`) over every
    rank. `objective` names an objective's own sums (DPO rewards, GRPO rewards and clip counts), kept in `own`."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device, objective: tuple[str, ...] = ()):
        per_layer = num_layers * num_experts
        self.totals = torch.zeros(4 + 2 * per_layer + num_layers + len(objective), dtype=torch.float64, device=device)
        self.sums_4 = self.totals[:4]
        self.counts_LE = self.totals[4 : 4 + per_layer].view(num_layers, num_experts)
        self.mean_prob_LE = self.totals[4 + per_layer : 4 + 2 * per_layer].view(num_layers, num_experts)
        self.entropy_L = self.totals[4 + 2 * per_layer : 4 + 2 * per_layer + num_layers]
        self.own = NamedSums(objective, self.totals[4 + 2 * per_layer + num_layers :])

    def add(self, parts: LossParts, output: ModelOutput, share: float) -> None:
        """One micro-batch, `share` of the global batch: loss sums as they are, means weighted by share."""
        correct = parts.correct.to(parts.lm_loss_sum.dtype)
        self.sums_4[:2] += torch.stack([parts.lm_loss_sum, correct]).double()
        self.add_router(parts.aux_loss, parts.z_loss, output, share)

    def add_router(
        self,
        aux_loss: torch.Tensor,
        z_loss: torch.Tensor,
        output: ModelOutput | list[MoEStats],
        share: float,
        layers: list[int] | None = None,
    ) -> None:
        """The routers' losses and loads of one forward that is `share` of the step: a model's output, or the
        statistics of the MoE layers `layers` (a pipeline stage's, by their index among all MoE layers)."""
        self.sums_4[2:] += torch.stack([share * aux_loss.detach(), share * z_loss.detach()]).double()
        moe_stats = output if isinstance(output, list) else output.moe_stats
        for index, stats in zip(layers or range(len(moe_stats)), moe_stats, strict=True):
            self.counts_LE[index] += stats.tokens_per_expert_E
            self.mean_prob_LE[index] += share * stats.mean_prob_E.double()
            self.entropy_L[index] += share * stats.entropy.double()

    def losses(self) -> tuple[float, float, float, float]:
        """(summed token loss, correct predictions, aux loss, z loss) of the step."""
        lm_sum, correct, aux, z = self.sums_4.tolist()
        return lm_sum, correct, aux, z

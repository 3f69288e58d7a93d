"""The training objective: next-token cross-entropy plus the routers' balancing losses."""

from __future__ import annotations

import torch

from ferry.data.targets import IGNORE_INDEX
from ferry.model import ModelOutput, MoEConfig
from ferry.model.config import MTPConfig
from ferry.train.objectives.cross_entropy import cross_entropy
from ferry.train.step_statistics import LossParts, NamedSums


def compute_loss(
    output: ModelOutput,
    targets_BS: torch.Tensor,
    moe: MoEConfig,
    trained_in_step: int,
    share_of_step: float,
    mtp: MTPConfig | None = None,
    own: NamedSums | None = None,
) -> LossParts:
    """The micro-batch's contribution to the step's loss, so that summing over micro-batches
    (and ranks) gives the mean over the whole global batch whatever the split.

    The LM term sums the losses of the trained targets (IGNORE_INDEX marks the others:
    prompts and padding of packed conversations) and divides by the trained targets of
    the whole step; the router terms (means over MoE layers) are weighted by the
    micro-batch's share. `correct` counts trained targets the model ranks first. Under context parallelism each
    sum is this rank's positions' part (`ModelOutput.own`), and the parts add up over the ranks. With
    multi-token prediction (`mtp`), each module's summed loss over the same denominator joins the objective with
    weight `mtp.loss_weight / depth`, and its sum and trained targets go to the step's `own` sums (`mtp_sums`).
    """
    if output.head_loss is not None:  # computed with the head, chunk by chunk
        lm_loss_sum, correct = output.head_loss.lm_loss_sum, output.head_loss.correct
    else:
        logits_TV = output.logits_BSV.reshape(-1, output.logits_BSV.shape[-1]).float()
        targets_T = output.own(targets_BS).reshape(-1)
        lm_loss_sum = cross_entropy(logits_TV, targets_T, IGNORE_INDEX, "sum")
        correct = (logits_TV.detach().argmax(dim=-1) == targets_T).sum()
    aux_loss, z_loss = router_losses(output)
    objective = lm_loss_sum / max(trained_in_step, 1) + share_of_step * router_objective(moe, aux_loss, z_loss)
    if output.mtp_losses:
        weight = mtp.loss_weight / len(output.mtp_losses)
        for depth, head in enumerate(output.mtp_losses, start=1):
            objective = objective + weight * head.lm_loss_sum / max(trained_in_step, 1)
            own.add(**{f"mtp{depth}_loss_sum": head.lm_loss_sum.detach(), f"mtp{depth}_targets": head.trained})
    return LossParts(objective, lm_loss_sum.detach(), correct, aux_loss.detach(), z_loss.detach())


def router_losses(output: ModelOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """The balancing and z losses of the forward, each a mean over its MoE layers (zero without any)."""
    if not output.moe_stats:
        device = (output.logits_BSV if output.head_loss is None else output.head_loss.lm_loss_sum).device
        zero = torch.zeros((), dtype=torch.float32, device=device)
        return zero, zero
    aux_loss = torch.stack([stats.aux_loss for stats in output.moe_stats]).mean()
    z_loss = torch.stack([stats.z_loss for stats in output.moe_stats]).mean()
    return aux_loss, z_loss


def router_objective(moe: MoEConfig, aux_loss: torch.Tensor, z_loss: torch.Tensor) -> torch.Tensor:
    """What the routers' losses add to any objective: the same weights whatever is being trained."""
    return moe.aux_loss_coef * aux_loss + moe.z_loss_coef * z_loss


def mtp_sums(depth: int) -> tuple[str, ...]:
    """The step's own sums of `depth` MTP modules: each one's summed loss and trained targets."""
    return tuple(name for k in range(1, depth + 1) for name in (f"mtp{k}_loss_sum", f"mtp{k}_targets"))


def mtp_figures(sums: dict[str, float], depth: int) -> dict:
    """The step record's `mtp.loss`: each module's mean loss over its trained targets."""
    if not depth:
        return {}
    means = {str(k): sums[f"mtp{k}_loss_sum"] / max(sums[f"mtp{k}_targets"], 1) for k in range(1, depth + 1)}
    return {"mtp.loss": means}

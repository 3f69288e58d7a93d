"""Top-k router: scores, expert choice (optionally group-limited), the balancing losses, and aux-loss-free bias
balancing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ferry.kernels import KernelSelection, portable_kernels
from ferry.kernels.amp import in_autocast_dtype
from ferry.metrics.moe import router_entropy
from ferry.model.config import MoEConfig
from ferry.model.sequence_split import SequenceSplit


@dataclass
class Routing:
    """Where each token goes and with what weight, plus the router's losses for this batch.

    `tokens_per_expert_E` counts every assignment, as the experts run them; `load_E` and the
    losses, probabilities and entropy count only the tokens that are not padding.
    """

    expert_ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    load_E: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    mean_prob_E: torch.Tensor
    entropy: torch.Tensor


class Router(nn.Module):
    """A linear router over the token's hidden state (with `moe.router_bias`, a learned bias on its logits, which
    moves choice and weights alike: GPT-OSS's).

    Scores are computed in fp32. With bias balancing, a per-expert bias is added to
    the scores for *choosing* experts only; the combine weights stay the unbiased
    scores, and the bias moves outside the gradient (see `update_bias`). It is
    DeepSeek-V3's correction bias. With `topk_group < n_group` a token chooses
    within its best groups only (`within_best_groups`); the weights, renormalised
    or not, are finally multiplied by `routed_scaling_factor`, which leaves the
    losses and diagnostics (computed from the scores and the choice) unchanged.
    """

    COMPUTE_WEIGHTS = ("weight_ED",)  # cast once a step under autocast (`ferry/precision/step_weights.py`)

    def __init__(self, dim: int, config: MoEConfig, kernels: KernelSelection | None = None):
        super().__init__()
        self._linear = (kernels or portable_kernels())["linear"]
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.score_func = config.score_func
        self.renormalize = config.renormalize
        self.n_group, self.topk_group, self.group_score = config.n_group, config.topk_group, config.group_score
        self.routed_scaling_factor = config.routed_scaling_factor
        self.bias_update_rate = config.bias_balancing.update_rate if config.bias_balancing.enabled else 0.0
        self.weight_ED = nn.Parameter(torch.empty(config.num_experts, dim))
        self.bias_E = nn.Parameter(torch.zeros(config.num_experts)) if config.router_bias else None
        self.register_buffer("expert_bias_E", torch.zeros(config.num_experts), persistent=True)
        self.sequence_split: SequenceSplit | None = None  # context parallelism: this rank's positions only

    def forward(self, x_TD: torch.Tensor, padding_T: torch.Tensor | None = None) -> Routing:
        """Route every token; with `padding_T` (True where a position only pads its row), padding is
        routed and run like any token but left out of the balancing and z losses, the load the bias
        follows and the diagnostics: a batch padded to its longest row must not teach the router to
        spread copies of the padding token over the experts."""
        logits_TE = self._linear(*in_autocast_dtype(x_TD, self.weight_ED)).float()
        if self.bias_E is not None:
            logits_TE = logits_TE + self.bias_E.float()
        if self.score_func == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
        else:
            scores_TE = logits_TE.sigmoid()
        with torch.no_grad():
            choice_TE = scores_TE + self.expert_bias_E if self.bias_update_rate else scores_TE
            if self.topk_group < self.n_group:
                choice_TE = within_best_groups(choice_TE, self.n_group, self.topk_group, self.group_score)
            expert_ids_TK = choice_TE.topk(self.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(1, expert_ids_TK)
        if self.renormalize:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights_TK = weights_TK * self.routed_scaling_factor
        tokens_per_expert_E = count_assignments(expert_ids_TK, self.num_experts)
        probs_TE = scores_TE if self.score_func == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
        squared_log_partition_T = torch.logsumexp(logits_TE, dim=-1).pow(2)
        if self.sequence_split is not None:
            load_E, aux_loss, z_loss, mean_prob_E, entropy = self._parts_of_split_sequences(
                expert_ids_TK, tokens_per_expert_E, probs_TE, squared_log_partition_T, padding_T
            )
        elif padding_T is None:
            load_E, counted = tokens_per_expert_E, scores_TE.shape[0]
            mean_prob_E, z_loss = probs_TE.mean(dim=0), squared_log_partition_T.mean()
            entropy = router_entropy(probs_TE.detach())
        else:
            counted_T = ~padding_T.reshape(-1)
            load_E = count_assignments(expert_ids_TK, self.num_experts, counted_T)
            weight_T = counted_T.to(scores_TE.dtype)
            counted = weight_T.sum().clamp(min=1.0)
            mean_prob_E = (probs_TE * weight_T[:, None]).sum(dim=0) / counted
            z_loss = (squared_log_partition_T * weight_T).sum() / counted
            entropy = router_entropy(probs_TE.detach(), weight_T)
        if self.sequence_split is None:
            aux_loss = self._load_balancing_loss(mean_prob_E, load_E, counted)
        return Routing(
            expert_ids_TK=expert_ids_TK,
            weights_TK=weights_TK.to(x_TD.dtype),
            tokens_per_expert_E=tokens_per_expert_E,
            load_E=load_E,
            aux_loss=aux_loss,
            z_loss=z_loss,
            mean_prob_E=mean_prob_E.detach(),
            entropy=entropy,
        )

    def _load_balancing_loss(
        self, mean_prob_E: torch.Tensor, load_E: torch.Tensor, num_tokens: int | torch.Tensor
    ) -> torch.Tensor:
        """Switch-style E * sum_e f_e * p_e, normalised so that perfect balance scores 1.

        f_e is the fraction of the counted tokens' T*K assignments that went to expert e, p_e
        the mean routing probability of e (sigmoid scores are normalised per token first).
        """
        fraction_E = load_E.to(mean_prob_E.dtype) / (num_tokens * self.top_k)
        return self.num_experts * torch.dot(fraction_E, mean_prob_E)

    def _parts_of_split_sequences(
        self,
        expert_ids_TK: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        probs_TE: torch.Tensor,
        squared_log_partition_T: torch.Tensor,
        padding_T: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Under context parallelism, this rank's part of the means the single process takes over every position
        of the micro-batch: its positions' sums over the whole micro-batch's count, so that the parts of the ranks
        add up to the whole. The balancing loss is linear in the mean probabilities once the load fractions (no
        gradient) are the whole's, so it splits into parts too. One all-reduce of the loads and the count."""
        counted_T = None if padding_T is None else ~padding_T.reshape(-1)
        load_E = tokens_per_expert_E
        if counted_T is not None:
            load_E = count_assignments(expert_ids_TK, self.num_experts, counted_T)
        weight_T = None if counted_T is None else counted_T.to(probs_TE.dtype)
        here = torch.tensor(float(probs_TE.shape[0]), device=probs_TE.device) if weight_T is None else weight_T.sum()
        whole_E1 = self.sequence_split.exchange.total(torch.cat([load_E.to(probs_TE.dtype), here[None]]))
        counted = whole_E1[-1].clamp(min=1.0)
        entropy = router_entropy(probs_TE.detach(), weight_T) * here / counted
        if weight_T is not None:
            probs_TE, squared_log_partition_T = probs_TE * weight_T[:, None], squared_log_partition_T * weight_T
        mean_prob_E = probs_TE.sum(dim=0) / counted
        aux_loss = self._load_balancing_loss(mean_prob_E, whole_E1[:-1], counted)
        return load_E, aux_loss, squared_log_partition_T.sum() / counted, mean_prob_E.detach(), entropy

    @torch.no_grad()
    def update_bias(self, tokens_per_expert_E: torch.Tensor) -> None:
        """Move each expert's bias toward the mean load: up when underloaded, down when overloaded."""
        if not self.bias_update_rate:
            return
        load_E = tokens_per_expert_E.to(self.expert_bias_E.dtype)
        self.expert_bias_E += self.bias_update_rate * torch.sign(load_E.mean() - load_E)


def within_best_groups(
    choice_TE: torch.Tensor, n_group: int, topk_group: int, group_score: str = "top2_sum"
) -> torch.Tensor:
    """The choice scores with every expert outside a token's `topk_group` best groups set to -inf.

    The experts split into `n_group` equal groups (on DeepSeek-V3, the experts of one node), a group
    scoring the sum of its two best experts' choice scores, as DeepSeek-V3 does, or its best expert's
    (`group_score: max`, DeepSeek-V2's group-limited greedy choice): a token then reaches at most
    `topk_group` groups, which bounds how many nodes its dispatch talks to.
    """
    tokens, num_experts = choice_TE.shape
    grouped_TGX = choice_TE.view(tokens, n_group, num_experts // n_group)
    best = 1 if group_score == "max" else min(2, grouped_TGX.shape[-1])
    group_scores_TG = grouped_TGX.topk(best, dim=-1).values.sum(dim=-1)
    best_TJ = group_scores_TG.topk(topk_group, dim=-1).indices
    kept_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, best_TJ, True)
    return grouped_TGX.masked_fill(~kept_TG[:, :, None], float("-inf")).view(tokens, num_experts)


def count_assignments(
    expert_ids_TK: torch.Tensor, num_experts: int, counted_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Assignments per expert (of the tokens `counted_T` marks, or of all), a tensor of fixed size on
    the device.

    Not `torch.bincount`: its output size depends on the largest id, which it reads on the host (a
    device sync on accelerators) and which a compiled graph cannot know in advance.
    """
    ids_N = expert_ids_TK.flatten()
    if counted_T is None:
        ones_N = torch.ones_like(ids_N)
    else:
        ones_N = counted_T[:, None].expand(expert_ids_TK.shape).flatten().to(ids_N.dtype)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device).scatter_add_(0, ids_N, ones_N)

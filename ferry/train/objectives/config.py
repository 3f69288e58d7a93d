"""Settings of the preference (DPO) and reinforcement-learning (GRPO) objectives.

`train.objective` picks what a run optimises: `lm` (next-token loss; pre-training, mid-training,
SFT), `dpo` or `grpo`. Both of the latter start from a parent checkpoint (`init_from`), which is also
their reference model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ferry.config.section import Section
from ferry.train.objectives.verifiers import VERIFIERS


class DPOConfig(Section):
    """Direct preference optimisation against the parent as the reference."""

    loss: Literal["sigmoid", "length_normalized", "ipo"] = "sigmoid"
    beta: float = Field(0.1, gt=0.0, description="how far the policy may move from the reference")
    nll_weight: float = Field(
        0.0,
        ge=0.0,
        description="add this times the chosen answer's per-token negative log-likelihood (RPO): keeps DPO from "
        "lowering the chosen answers along with the rejected ones",
    )
    score_batch: int = Field(64, ge=1, description="pairs per forward when scoring the reference and held-out pairs")
    reference_cache: str | None = Field(
        None,
        description="directory of cached reference log-probs (default <run.dir>/reference-cache); an entry is keyed "
        "by the parent checkpoint's digest, the data and these settings",
    )


class GRPOConfig(Section):
    """Group-relative policy optimisation with a verifier as the reward: `train.global_batch` prompts a step,
    `group_size` completions each."""

    group_size: int = Field(8, ge=2, description="completions sampled per prompt (a group of 1 has no baseline)")
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature of the rollouts")
    verifier: str = Field("exact", description="how a completion is scored: exact, numeric, or a registered name")
    scale_rewards: bool = Field(True, description="divide advantages by the group's reward standard deviation")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="the ratio's lower bound is 1 - clip_low")
    clip_high: float = Field(0.28, ge=0.0, description="the ratio's upper bound is 1 + clip_high")
    kl_coef: float = Field(0.0, ge=0.0, description="weight of the k3 KL penalty to the reference; 0 = none")
    iterations: int = Field(1, ge=1, description="optimizer updates on each step's rollouts (1: on-policy)")
    eval_max_new_tokens: int | None = Field(None, ge=1, description="greedy held-out decoding; default max_new_tokens")

    @field_validator("verifier")
    @classmethod
    def _verifier_known(cls, verifier: str) -> str:
        if verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {verifier!r}; available: {', '.join(sorted(VERIFIERS))}")
        return verifier


Objective = Literal["lm", "dpo", "grpo"]  # the variants of `ferry.train.objectives.kinds`

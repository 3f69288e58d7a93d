"""The GRPO objective: sample a group of completions per prompt, score them with a verifier, and push the
policy towards the completions that beat their group.

A step takes `train.global_batch` prompts; each rank samples `group_size` completions of
its prompts with the KV-cache decoder (timed as `generate`), so a prompt's group never
spans ranks and its advantages need no communication. Groups whose rewards are all equal
carry no signal and are left out; the loss is summed over the remaining completion tokens
and divided by their count over every rank (each token weighs the same, whatever its
completion's length). Every rank runs the same number of forwards (expert parallelism
needs every rank in every all-to-all): a rank with fewer micro-batches runs fillers
weighted zero.

The sampler's generator of completion g of prompt record i at step s is seeded with
(run.seed, s, i, g): a resumed run draws the same completions, and a prompt's draws do not
depend on the world size or on which other prompts share its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from ferry.config import UserError
from ferry.data import DataCursor
from ferry.data.chat_template import chat_of
from ferry.data.records import RecordDataset
from ferry.data.targets import completion_batch
from ferry.inference import GenerationConfig
from ferry.inference.evaluation import held_out_due
from ferry.inference.generate import GenerationResult
from ferry.inference.scoring import ScoringPass
from ferry.train.objectives.base import RecordTraining, StepOutcome
from ferry.train.objectives.config import GRPOConfig
from ferry.train.objectives.losses import router_losses, router_objective
from ferry.train.objectives.preference_losses import (
    clipped_policy_loss,
    group_advantages,
    k3_kl,
    token_logprobs,
)
from ferry.train.objectives.verifiers import VERIFIERS
from ferry.train.step_context import ForwardPass
from ferry.train.step_statistics import LossParts

if TYPE_CHECKING:
    from ferry.data.targets import Batch
    from ferry.model import ModelOutput, Transformer
    from ferry.train.step_context import StepContext
    from ferry.train.step_statistics import NamedSums, StepStatistics

# generating completions: `(prompts, config, end_ids=..., row_seeds=..., progress=...)` -> GenerationResult, as a
# step context's `generate`, or `ferry.inference.generate` bound to a whole model in one process
Generation = Callable[..., GenerationResult]

# the sums of a step: rewards, the groups' reward spreads, groups, completions, completion tokens, kept groups,
# trained tokens, clipped tokens, the KL, the tokens trained on (prompts and completions of the kept groups, once
# per update; the rollouts' decoding is timed but not counted), the loss, completions accepted
GRPO_STATISTICS = (
    "reward",
    "reward_spread",
    "groups",
    "completions",
    "completion_tokens",
    "kept_groups",
    "trained_tokens",
    "clipped_tokens",
    "kl",
    "tokens",
    "loss",
    "accepted",
)
_SEED_STREAM = 0x6E90
_EVAL_STREAM = 0xE7A1
EVAL_SAMPLES = 4


@dataclass
class Rollouts:
    """One rank's sampled completions of a step, grouped by prompt."""

    prompts: list[np.ndarray]
    completions: list[np.ndarray]
    rewards_PG: torch.Tensor
    advantages_PG: torch.Tensor
    kept_P: torch.Tensor


class GRPOObjective:
    statistics = GRPO_STATISTICS

    def __init__(
        self,
        config: GRPOConfig,
        records: RecordTraining,
        seed: int,
    ):
        """`records`: the prompts, the held-out prompt sets and the stage's parent (its model only with
        `kl_coef`); `seed`: the run's, from which every completion's sampler is seeded."""
        self.config = config
        self.loader = records.loader
        self.seed = seed
        self.dataset: RecordDataset = records.loader.dataset
        self.held_out = records.held_out
        self.micro_batch = records.micro_batch
        self.moe = records.moe
        self.chat = chat_of(self.dataset.path / self.dataset.tokenizer["file"])
        self.stop_ids = self.chat.end_ids
        self.pad_id = self.dataset.tokenizer["eos_id"]
        self.verify = VERIFIERS[self.config.verifier]
        self.prompts_per_step = records.loader.global_batch
        self.eval_interval = records.eval_interval
        for dataset in [self.dataset, *self.held_out.values()]:
            longest = int((dataset.spans[:, 0, 1] - dataset.spans[:, 0, 0]).max())
            if longest + self.config.max_new_tokens > records.max_seq_len:
                raise UserError(
                    f"{dataset.label}: a prompt of {longest} tokens plus grpo.max_new_tokens "
                    f"({self.config.max_new_tokens}) exceeds model.max_seq_len ({records.max_seq_len})"
                )
        self.references = records.references
        self.reference_model: Transformer | None = None
        self.reference_pointer: dict | None = None

    def prepare(self, context: StepContext) -> list[str]:
        parent = self.references.checkpoint()
        self.reference_pointer = self.references.pointer(parent)
        if self.config.kl_coef > 0:
            self.reference_model = self.references.model(parent)
            return [f"KL reference: {parent.path} (step {parent.step})"]
        return []

    def step(self, context: StepContext, cursor: DataCursor, statistics: StepStatistics) -> StepOutcome:
        records = self.loader.step_records(cursor, context.rank, context.world_size)
        with context.phase("generate"):
            rollouts = self._rollouts(context, records.indices, step=cursor.step)
        own = statistics.own
        group = self.config.group_size
        rewards_PG = rollouts.rewards_PG
        own.add(
            reward=rewards_PG.sum().item(),
            reward_spread=rewards_PG.std(dim=1).sum().item(),
            groups=rewards_PG.shape[0],
            completions=rewards_PG.numel(),
            completion_tokens=sum(len(completion) for completion in rollouts.completions),
            kept_groups=rollouts.kept_P.sum().item(),
            accepted=(rewards_PG >= 1.0).sum().item(),
        )
        kept = [index for index in range(len(rollouts.completions)) if rollouts.kept_P[index // group]]
        trained_sequences = sum(len(rollouts.prompts[i]) + len(rollouts.completions[i]) for i in kept)
        own.add(tokens=trained_sequences * self.config.iterations)
        trained_tokens = context.reductions.sum(sum(len(rollouts.completions[i]) for i in kept))
        micro = self.micro_batch * group
        batches = [kept[start : start + micro] for start in range(0, len(kept), micro)]
        rounds = int(context.reductions.largest([float(len(batches))])[0])
        if trained_tokens == 0:
            return StepOutcome(False, 0.0, tokens=0)
        micro_batches = [
            self._micro_batch(context, rollouts, batches[index] if index < len(batches) else [])
            for index in range(rounds)
        ]
        grad_norm, stepped = 0.0, False
        for iteration in range(self.config.iterations):
            context.zero_grad()
            update = _Update(trained_tokens, iteration, own)
            context.train_passes([self._train_pass(micro, update) for micro in micro_batches], statistics)
            grad_norm, stepped = context.update(cursor.step + 1)
        return StepOutcome(stepped, grad_norm, tokens=0)

    def figures(self, statistics: StepStatistics, outcome: StepOutcome) -> dict:
        """Means over the step's completions and groups; KL and clipping over the trained tokens of every update
        (the first update's ratios are all 1: clipping shows from the second on, with `grpo.iterations` > 1)."""
        sums = statistics.own.values()
        outcome.tokens = int(sums["tokens"])
        per_token = max(sums["trained_tokens"], 1.0)
        completions, groups = sums["completions"], sums["groups"]
        return {
            "loss": sums["loss"],
            "reward": sums["reward"] / completions,
            "reward_std": sums["reward_spread"] / groups,
            "solve_rate": sums["accepted"] / completions,
            "kl": sums["kl"] / per_token,
            "clip_fraction": sums["clipped_tokens"] / per_token,
            "completion_length": sums["completion_tokens"] / completions,
            "filtered_groups": 1.0 - sums["kept_groups"] / groups,
        }

    def evaluation_due(self, step: int, last_step: int) -> bool:
        return held_out_due(bool(self.held_out), self.eval_interval, step, last_step)

    @torch.no_grad()
    def evaluate(self, context: StepContext) -> dict:
        """Solve rates of every held-out prompt set, the prompts split over the ranks: sampled as the rollouts
        are (`eval/solve_rate`: `EVAL_SAMPLES` completions a prompt, fixed seeds, so evaluations compare) and
        greedy (`eval/greedy_solve_rate`)."""
        sampled: dict[str, float] = {}
        greedy: dict[str, float] = {}
        max_new_tokens = self.config.eval_max_new_tokens or self.config.max_new_tokens
        for name, dataset in self.held_out.items():
            for rates, temperature, samples in ((sampled, self.config.temperature, EVAL_SAMPLES), (greedy, 0.0, 1)):
                solved = solved_prompts(
                    context.generate,
                    dataset,
                    self.verify,
                    max_new_tokens,
                    context.rank,
                    context.world_size,
                    temperature=temperature,
                    samples=samples,
                    seed=self.seed,
                    progress=context.progress,
                )
                rates[name] = context.reductions.sum(solved) / len(dataset)
        return {"eval/solve_rate": sampled, "eval/greedy_solve_rate": greedy}

    def state(self) -> dict:
        return {
            "kind": "grpo",
            "reference": self.reference_pointer,
            "sampler": {"seed": self.seed, "scheme": "per completion: (run.seed, step, prompt record, sample)"},
        }

    def load_state(self, state: dict | None) -> None:
        if state and state.get("kind") == "grpo" and state["sampler"]["seed"] != self.seed:
            raise UserError(
                f"the checkpoint's rollouts were drawn with run.seed {state['sampler']['seed']}, this run's is "
                f"{self.seed}: resume with the same seed"
            )

    def _rollouts(self, context: StepContext, indices: list[int], step: int) -> Rollouts:
        group = self.config.group_size
        prompts = [self.dataset.field(index, "prompt") for index in indices for _ in range(group)]
        seeds = [_seed(self.seed, _SEED_STREAM, step, index, sample) for index in indices for sample in range(group)]
        sampling = GenerationConfig(max_new_tokens=self.config.max_new_tokens, temperature=self.config.temperature)
        result = context.generate(prompts, sampling, end_ids=self.stop_ids, row_seeds=seeds)
        completions = [np.asarray(completion.tokens, dtype=np.int64) for completion in result.completions]
        rewards = [
            self._reward(completion.tokens, self.dataset.answers[index])
            for completion, index in zip(result.completions, [i for i in indices for _ in range(group)])
        ]
        rewards_PG = torch.tensor(rewards, dtype=torch.float32).view(len(indices), group)
        advantages_PG = group_advantages(rewards_PG, self.config.scale_rewards)
        kept_P = rewards_PG.max(dim=1).values > rewards_PG.min(dim=1).values
        return Rollouts(prompts, completions, rewards_PG, advantages_PG, kept_P)

    def _reward(self, tokens: list[int], answer: str) -> float:
        return self.verify(self.chat.answer_text(tokens), answer)

    def _micro_batch(self, context: StepContext, rollouts: Rollouts, rows: list[int]) -> _MicroBatch:
        """Kept completions `rows` as one micro-batch (none: a zero-weight filler that keeps the ranks in step), with
        the reference's log-probs of its tokens when the loss has a KL term."""
        filler = not rows
        rows = rows or [0]
        prompts = [rollouts.prompts[row] for row in rows]
        completions = [rollouts.completions[row] for row in rows]
        batch = completion_batch(prompts, completions, self.pad_id).to(context.device)
        advantages_B1 = rollouts.advantages_PG.view(-1)[rows].to(context.device)[:, None]
        share = 0.0 if filler else len(rows) / (self.prompts_per_step * self.config.group_size)
        reference_BS = None
        if self.reference_model is not None:
            scoring = ScoringPass(batch.inputs_BS, batch.padding_BS, partial(_token_logprobs, batch.targets_BS))
            reference_BS = context.score(scoring, model=self.reference_model)
        return _MicroBatch(batch, advantages_B1, 0.0 if filler else 1.0, share, reference_BS)

    def _train_pass(self, micro: _MicroBatch, update: _Update) -> ForwardPass:
        """One micro-batch of an update: its figures count in the first update only (a filler's never)."""
        batch = micro.batch
        counted = update.iteration == 0 and micro.weight > 0
        loss = partial(self._policy_loss, micro, update)
        return ForwardPass(batch.inputs_BS, None, batch.padding_BS, None, micro.share, loss, counted=counted)

    def _policy_loss(self, micro: _MicroBatch, update: _Update, output: ModelOutput) -> LossParts:
        """The clipped policy loss of a micro-batch's completion tokens over the step's trained tokens (the KL to
        the reference added), with its routers' share; the first update's log-probs are the old policy's."""
        targets_BS = micro.batch.targets_BS
        mask_BS = targets_BS >= 0
        logps_BS = token_logprobs(output.logits_BSV, targets_BS)
        if update.iteration == 0:
            micro.old_logps_BS = logps_BS.detach()
        losses_BS, clipped_BS = clipped_policy_loss(
            logps_BS, micro.old_logps_BS, micro.advantages_B1, self.config.clip_low, self.config.clip_high
        )
        kl_BS = torch.zeros_like(logps_BS)
        if micro.reference_BS is not None:
            kl_BS = k3_kl(logps_BS, micro.reference_BS)
            losses_BS = losses_BS + self.config.kl_coef * kl_BS
        policy_loss = (losses_BS * mask_BS).sum() / update.trained_tokens
        aux_loss, z_loss = router_losses(output)
        objective = micro.weight * policy_loss + micro.share * router_objective(self.moe, aux_loss, z_loss)
        if micro.weight > 0:
            update.own.add(  # clipping and KL: over the tokens of every update
                trained_tokens=mask_BS.sum().item(),
                clipped_tokens=(clipped_BS & mask_BS).sum().item(),
                kl=(kl_BS.detach() * mask_BS).sum().item(),
            )
            if update.iteration == 0:  # the loss: as the first update saw it
                update.own.add(loss=policy_loss.detach().item())
        return LossParts.of_objective(objective, aux_loss, z_loss)


@dataclass
class _MicroBatch:
    """Kept completions trained together: their batch, advantages, weight (0: a filler), share of the step's
    completions, the reference's log-probs of their tokens (None without a KL term), and the old policy's (the
    first update's, kept for the later ones)."""

    batch: Batch
    advantages_B1: torch.Tensor
    weight: float
    share: float
    reference_BS: torch.Tensor | None
    old_logps_BS: torch.Tensor | None = None


@dataclass(frozen=True)
class _Update:
    """One update over a step's rollouts: the completion tokens it trains on over every rank, which of the step's
    `grpo.iterations` it is, and the step's own sums."""

    trained_tokens: int
    iteration: int
    own: NamedSums


def _token_logprobs(targets_BS: torch.Tensor, output: ModelOutput) -> torch.Tensor:
    return token_logprobs(output.logits_BSV, targets_BS)


@torch.no_grad()
def solved_prompts(
    generation: Generation,
    dataset: RecordDataset,
    verify: Callable[[str, str], float],
    max_new_tokens: int,
    rank: int = 0,
    world_size: int = 1,
    temperature: float = 0.0,
    samples: int = 1,
    seed: int = 0,
    progress: Callable[[], None] | None = None,
) -> float:
    """How many of this rank's share of `dataset`'s prompts are solved: each prompt counts the share of its
    `samples` completions the verifier accepts (greedy at temperature 0). Sample j of prompt i is drawn with
    the seed (seed, i, j) whatever the ranks. A rank without prompts of its own still decodes one, uncounted,
    to stay in step with the others. `generation`: a step context's, or `partial(generate, model)` in one
    process. `progress()` is called at every decoding step."""
    chat = chat_of(dataset.path / dataset.tokenizer["file"])
    per_rank = -(-len(dataset) // world_size)
    mine = list(range(rank * per_rank, min((rank + 1) * per_rank, len(dataset))))
    rows = [index for index in mine for _ in range(samples)] or [0]
    seeds = [_seed(seed, _EVAL_STREAM, index, sample) for index in mine for sample in range(samples)] or [0]
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature)
    result = generation(
        [dataset.field(row, "prompt") for row in rows], config, end_ids=chat.end_ids, row_seeds=seeds, progress=progress
    )
    if not mine:
        return 0.0
    accepted = [
        verify(chat.answer_text(completion.tokens), dataset.answers[row]) >= 1.0
        for row, completion in zip(rows, result.completions)
    ]
    return sum(accepted) / samples


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])

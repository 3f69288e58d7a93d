"""`parallel.cp`: context parallelism. Each of `cp` consecutive ranks computes its part of every sequence (chunks i
and 2cp-1-i of 2cp, for causal balance) and attention gathers the keys and values of the whole
(`ferry/parallel/context_parallel.py`); the ranks of a group read the same rows (`ferry/train/sequence_context.py`).
It places no weight: its ranks are replicas like any other, so every other kind's rules hold for it unchanged."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ferry.config.refusals import Refusal
from ferry.parallel.context_parallel import exchange_figures
from ferry.train.layouts.base import LayoutKind, MemoryTerms, PlacedRun, Traffic
from ferry.train.layouts.sizes import activation_bytes
from ferry.train.sequence_context import SequenceSplitContext

if TYPE_CHECKING:
    from ferry.parallel.layout import JobLayout
    from ferry.parallel.plan import ParallelPlan
    from ferry.train.step_context import ContextParts, PassShape, TrainingContext


class ContextParallel(LayoutKind):
    name: ClassVar[str] = "context-parallel"

    def active(self, config: Any) -> bool:
        return config.parallel.cp > 1

    def refusals(self, config: Any) -> list[Refusal]:
        cp, model, objective = config.parallel.cp, config.model, config.train.objective
        if cp == 1:
            return []
        refused = []
        if model.mtp.depth:
            refused.append(
                Refusal(
                    "parallel",
                    f"cp {cp}: model.mtp's modules read tokens further on in the row, which another context-parallel "
                    "rank holds; set model.mtp.depth=0 or cp=1",
                )
            )
        for field in ("sliding_window", "attention_sinks"):  # a rank masks gathered keys by its own positions only
            if getattr(model, field):
                refused.append(
                    Refusal(
                        "parallel",
                        f"cp {cp}: model.{field} is not computed over a split sequence; set cp=1 for this model (ep, "
                        "pp, zero and fsdp train it)",
                    )
                )
        if objective == "grpo":
            refused.append(
                Refusal(
                    "parallel",
                    f"cp {cp}: objective grpo generates its rollouts a token at a time from a cache of whole "
                    "sequences, which a context-parallel rank does not hold; set cp=1 for grpo (dpo and lm, SFT "
                    "included, train under cp)",
                )
            )
        return refused

    def memory(self, config: Any, layout: JobLayout, terms: MemoryTerms) -> MemoryTerms:
        """A rank keeps its 1/cp of the positions, and for each of them what the attention gathers of the other
        ranks' (`AttentionKind.gathered_values`)."""
        cp, model = config.parallel.cp, config.model
        gathered = (cp - 1) * model.attention_kind.gathered_values(model, config.train.activation_checkpointing)
        return terms.with_(
            tokens=terms.tokens // cp,
            extra_kept_per_token_layer=terms.extra_kept_per_token_layer + gathered * terms.compute_bytes,
        )

    def traffic(self, config: Any, layout: JobLayout, micro_batch: int) -> list[Traffic]:
        """Each layer's attention gathers the group's keys and values every micro-batch, and its backward sums their
        gradients back (ferry's collectives: the step record's `cp.bytes`)."""
        cp, model = layout.cp, config.model
        micro_batches = config.train.global_batch // (micro_batch * layout.data_ranks)
        own = micro_batch * config.data.seq_len // cp
        kept = model.attention_kind.gathered_values(model, "none")  # a position's keys and values
        gathered = cp * own * kept * activation_bytes(config)
        calls = micro_batches * (model.n_layers + model.mtp.depth) // layout.pp
        return [
            Traffic("cp_gather", calls, gathered, "cp", cp),
            Traffic("cp_gather_backward", calls, gathered, "cp", cp),
        ]

    def step_context(self, run: PlacedRun, shape: PassShape, context: ContextParts) -> TrainingContext:
        return SequenceSplitContext(context, run.plan)

    def figures(self, plan: ParallelPlan, exchanged: dict) -> dict:
        return exchange_figures(exchanged)

    def banner(self, layout: JobLayout) -> str:
        return f"cp {layout.cp}"

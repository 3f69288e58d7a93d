"""`parallel.mode: fsdp`: the FSDP2 weight-gathering baseline the expert-resident design is measured against
(`ferry/parallel/fsdp.py`). Every block is sharded over all ranks and gathered for each forward and backward, and
its gradients reduce-scattered inside the backward; experts are replicated like any weight."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ferry.config.refusals import Refusal
from ferry.train.layouts.base import LayoutKind, MemoryTerms, Traffic
from ferry.train.layouts.sizes import param_bytes, param_counts, reduce_bytes

if TYPE_CHECKING:
    from ferry.parallel.layout import JobLayout


class FullySharded(LayoutKind):
    name: ClassVar[str] = "fully-sharded"
    casts_weights_itself: ClassVar[bool] = True  # it gathers and casts each block's weights for its passes
    mode: ClassVar[str] = "fsdp"  # the `parallel.mode` that places the weights so

    def active(self, config: Any) -> bool:
        return config.parallel.mode == self.mode

    def refusals(self, config: Any) -> list[Refusal]:
        if not self.active(config):
            return []
        refused = []
        skip = config.model.skip_kind
        if skip.unfinished_output:
            refused.append(
                Refusal(
                    "parallel",
                    f"mode fsdp: model.skip {skip.name} {skip.unfinished_output}, and FSDP gathers a block's weights "
                    "for its backward only from the tensors the block returns; use mode=ep (with optim.zero=true to "
                    "shard the optimizer) or model.skip=standard",
                )
            )
        if config.optim.muon.qk_clip is not None:
            refused.append(
                Refusal(
                    "parallel",
                    "mode fsdp: optim.muon.qk_clip scales rows of the query and key weights by head, and FSDP holds a "
                    "shard of them on every rank: set mode=ep, or leave optim.muon.qk_clip unset",
                )
            )
        if config.optim.zero:
            refused.append(
                Refusal(
                    "optim.zero",
                    "FSDP already shards optimizer state; set optim.zero=false with parallel.mode=fsdp (or "
                    "parallel.mode=ep with optim.zero=true)",
                )
            )
        if config.parallel.pp > 1:
            refused.append(
                Refusal("parallel", "pp composes with mode ep (expert-resident); the FSDP baseline runs with pp 1")
            )
        return refused

    def banner(self, layout: JobLayout) -> str:
        return f"ep {layout.ep_degree}"  # experts replicated: the banner says so as for any run

    def memory(self, config: Any, layout: JobLayout, terms: MemoryTerms) -> MemoryTerms:
        """Every parameter and its optimizer state split over all the ranks."""
        local = terms.share.total_params / terms.world_size
        return terms.with_(local=local, moments=local, weights_sharded_over=terms.world_size)

    def traffic(self, config: Any, layout: JobLayout, micro_batch: int) -> list[Traffic]:
        """Every micro-batch gathers each block's weights for its forward and again for its backward, and
        reduce-scatters its gradients (torch's collectives, not ferry's: the step record does not count them)."""
        ranks = layout.world_size
        if ranks == 1:
            return []
        micro_batches = config.train.global_batch // (micro_batch * layout.data_ranks)
        weights = param_counts(config).total
        gathered = weights * param_bytes(config)
        return [
            Traffic("fsdp_all_gather", 2 * micro_batches, gathered, "world", ranks),
            Traffic("fsdp_reduce_scatter", micro_batches, weights * reduce_bytes(config), "world", ranks),
        ]

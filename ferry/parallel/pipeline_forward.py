"""A pipelined model's forwards without gradients, one batch at a time: scoring (reference log-probs, held-out
figures) and decoding, each stage filling a key/value cache for its own blocks.

The training schedule (torch's, `pipeline_schedule.py`) needs the shapes the stages exchange fixed in advance and
runs a step's micro-batches together; a forward without a backward needs neither. Every rank of a pipeline reads
the same rows, so each knows the shape of the residual stream it will receive: the stages run in order, each
receiving the stream from the rank of the stage before, running its blocks and handing the stream on, and the last
stage reduces the model's output to what the caller asks for (summed log-probs, the last position's logits). That
result is broadcast to every rank of the pipeline, which then goes on as a single process would (sampling the same
next tokens from the same logits with the same generators).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ferry.comm.collectives import Collectives
from ferry.model import KVCache, ModelOutput, Transformer
from ferry.model.head_loss import HeadTargets, chunked_head_loss
from ferry.model.sequence_split import SequenceSplit
from ferry.parallel.pipeline_split import StageSplit

# what a result may be, by the code its header carries
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool)
_MAX_DIMS = 4


class StagedForward:
    """Forwards of `model` (pruned to this rank's stages of `split`) over the pipeline's ranks `pp`; the stream
    passes between ranks in `stream_dtype` (the parameters')."""

    def __init__(self, model: Transformer, split: StageSplit, pp: Collectives, stream_dtype: torch.dtype):
        self.model = model
        self.split = split
        self.pp = pp
        self.stream_dtype = stream_dtype

    @torch.no_grad()
    def __call__(
        self,
        tokens_BS: torch.Tensor,
        reduce: Callable[[ModelOutput], torch.Tensor],
        cache: KVCache | None = None,
        padding_BS: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        head: HeadTargets | None = None,
    ) -> torch.Tensor:
        """`reduce(output)` of the model's output for `tokens_BS`, on every rank of the pipeline; with a cache, the
        tokens continue what it holds (each rank writes its blocks' layers). Attention stays within the documents
        of `document_ids_BS`; with `head`, the last stage computes the head and loss together, as the whole model's
        forward does."""
        model, split = self.model, self.split
        step = cache.begin(tokens_BS.shape[1]) if cache is not None else None
        sequences = model.sequence_split if cache is None else None  # context parallelism: this rank's positions
        if sequences is None:
            visible_BSS = Transformer.visibility(document_ids_BS)
        else:
            tokens_BS, padding_BS, head, visible_BSS = Transformer.own_positions(
                sequences, tokens_BS, document_ids_BS, padding_BS, head
            )
        last = split.num_stages - 1
        x_BSD = None
        result = None
        for stage in split.stages_of(self.pp.rank):
            if stage == 0:
                x_BSD = model.tok_embeddings(tokens_BS)
            elif self._owner(stage - 1) != self.pp.rank:
                x_BSD = self._receive(tokens_BS, self._owner(stage - 1))
            for index in split.blocks[stage]:
                layer_cache = cache.layer(index, step) if cache is not None else None
                x_BSD, _ = model.layers[index](x_BSD, layer_cache, visible_BSS, padding_BS)
            if stage == last:
                result = reduce(self._output(model.norm(x_BSD), head, sequences))
            elif self._owner(stage + 1) != self.pp.rank:
                self._send(x_BSD, self._owner(stage + 1))
        if cache is not None:
            cache.commit(step)
        return self._broadcast(result, self._owner(last))

    def _output(self, h_BSD: torch.Tensor, head: HeadTargets | None, sequences: SequenceSplit | None) -> ModelOutput:
        if head is not None:
            return ModelOutput(None, [], chunked_head_loss(h_BSD, self.model.output.weight, head), sequences)
        return ModelOutput(self.model.output(h_BSD), [], split=sequences)

    def _owner(self, stage: int) -> int:
        return stage % self.split.pp

    def _send(self, x_BSD: torch.Tensor, to: int) -> None:
        dist.send(x_BSD.to(self.stream_dtype).contiguous(), self.pp.group_rank_to_global(to), group=self.pp.group)

    def _receive(self, tokens_BS: torch.Tensor, source: int) -> torch.Tensor:
        shape = (*tokens_BS.shape, self.model.config.dim)
        x_BSD = torch.empty(shape, dtype=self.stream_dtype, device=tokens_BS.device)
        dist.recv(x_BSD, self.pp.group_rank_to_global(source), group=self.pp.group)
        return x_BSD

    def _broadcast(self, result: torch.Tensor | None, owner: int) -> torch.Tensor:
        """The owner's `result` on every rank of the pipeline: a header (its dtype and shape), then the tensor."""
        device = next(self.model.parameters()).device
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
        if result is not None:
            if result.dim() > _MAX_DIMS:
                raise ValueError(f"a staged forward returns at most {_MAX_DIMS} dimensions, not {result.dim()}")
            header[0], header[1] = _DTYPES.index(result.dtype), result.dim()
            header[2 : 2 + result.dim()] = torch.tensor(result.shape, dtype=torch.int64)
        source = self.pp.group_rank_to_global(owner)
        dist.broadcast(header, source, group=self.pp.group)
        dtype_code, dims, *shape = header.tolist()
        if result is None:
            result = torch.empty(shape[:dims], dtype=_DTYPES[dtype_code], device=device)
        result = result.contiguous()
        dist.broadcast(result, source, group=self.pp.group)
        return result


class StagedDecoder:
    """What `ferry.inference.generate` decodes with under pipeline parallelism: each forward returns the last
    position's logits of every row, on every rank of the pipeline, and fills each stage's layers of the cache."""

    def __init__(self, staged: StagedForward):
        self.staged = staged
        self.config = staged.model.config

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.staged.model.parameters()

    def held_blocks(self) -> list[int]:
        """This stage's blocks: the layers its part of the cache keeps."""
        return self.staged.model.held_blocks()

    @property
    def training(self) -> bool:
        return self.staged.model.training

    def train(self, mode: bool = True) -> StagedDecoder:
        self.staged.model.train(mode)
        return self

    def eval(self) -> StagedDecoder:
        return self.train(False)

    def __call__(self, tokens_BS: torch.Tensor, cache: KVCache | None = None) -> ModelOutput:
        logits_B1V = self.staged(tokens_BS, lambda output: output.logits_BSV[:, -1:], cache)
        return ModelOutput(logits_B1V, [])

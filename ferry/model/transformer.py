"""The decoder-only transformer: embeddings, blocks of attention + (dense | MoE) FFN, LM head."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ferry.data.targets import IGNORE_INDEX
from ferry.kernels import KernelSelection, portable_kernels
from ferry.model.config import ModelConfig
from ferry.model.farskip import FarSkipStream, LateOutput
from ferry.model.feedforward import SwiGLU
from ferry.model.head_loss import HeadLoss, HeadTargets, chunked_head_loss
from ferry.model.initialisation import truncated_normal_
from ferry.model.kv_cache import KVCache, LayerCache
from ferry.model.linear import Linear
from ferry.model.moe import MoELayer, MoEStats
from ferry.model.mtp import MTPModule, ahead, targets_ahead
from ferry.model.norm import RMSNorm
from ferry.model.parameter_kinds import is_bias
from ferry.model.recompute import Recompute, recomputed
from ferry.model.rope import RotaryEmbedding
from ferry.model.sequence_split import SequenceSplit


@dataclass
class ModelOutput:
    """Logits, or with targets the head's loss instead (`head_loss`, logits None, and each multi-token-prediction
    module's, `mtp_losses`), and one `MoEStats` per MoE layer (in layer order, the MTP modules' last). Under
    context parallelism (`split`) they are this rank's positions only: a loss
    reads its per-position tensors through `own` and makes a sum over positions whole with `summed`."""

    logits_BSV: torch.Tensor | None
    moe_stats: list[MoEStats]
    head_loss: HeadLoss | None = None
    split: SequenceSplit | None = None
    mtp_losses: list[HeadLoss] = field(default_factory=list)  # with targets: each MTP module's, depth by depth

    def own(self, x_BS: torch.Tensor, fill: float | int | bool = IGNORE_INDEX) -> torch.Tensor:
        """This output's positions of `x_BS`, a tensor over the whole sequence (targets, masks): itself unless the
        sequence is split, else padded with `fill` as the inputs were (to the length the logits make whole)."""
        if self.split is None:
            return x_BS
        padded = None if self.logits_BSV is None else self.logits_BSV.shape[1] * self.split.degree
        return self.split.local(x_BS, fill, padded)

    def summed(self, part: torch.Tensor) -> torch.Tensor:
        """A sum over this output's positions made the sum over the whole sequence (every rank's part), with the
        gradient of each rank's loss flowing to its own part."""
        return part if self.split is None else self.split.exchange.sum_parts(part)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(x)); with `model.skip: farskip` the stream in and
    out is a `FarSkipStream` and the previous block's FFN output joins after this block's attention."""

    def __init__(
        self,
        config: ModelConfig,
        rope: RotaryEmbedding,
        use_moe: bool,
        kernels: KernelSelection,
        recompute: Recompute = "none",
        track_max_logits: bool = False,
        window: int = 0,
    ):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps, kernels)
        self.attn = config.attention_kind.module(config, rope, kernels, track_max_logits, window)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, kernels)
        dense = not use_moe
        self.ffn = (
            SwiGLU(config.dim, config.dense_ffn_dim, kernels) if dense else MoELayer(config.dim, config.moe, kernels)
        )
        self.recompute = recompute

    def forward(
        self,
        x_BSD: torch.Tensor | FarSkipStream,
        cache: LayerCache | None = None,
        visible_BSS: torch.Tensor | None = None,
        padding_BS: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | FarSkipStream, MoEStats | None]:
        """The block's output and its MoE statistics; in training, checkpointed as `recompute` says (decoding
        and no-grad forwards keep nothing for a backward, so there is nothing to save)."""
        forward = self._forward_farskip if isinstance(x_BSD, FarSkipStream) else self._forward
        if self.recompute != "none" and cache is None and torch.is_grad_enabled():
            return recomputed(forward, self.recompute, x_BSD, cache, visible_BSS, padding_BS)
        return forward(x_BSD, cache, visible_BSS, padding_BS)

    def _forward(
        self,
        x_BSD: torch.Tensor,
        cache: LayerCache | None,
        visible_BSS: torch.Tensor | None,
        padding_BS: torch.Tensor | None,
    ) -> tuple[torch.Tensor, MoEStats | None]:
        h_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cache, visible_BSS)
        if isinstance(self.ffn, MoELayer):
            ffn_BSD, stats = self.ffn(self.ffn_norm(h_BSD), padding_BS)
            return h_BSD + ffn_BSD, stats
        return h_BSD + self.ffn(self.ffn_norm(h_BSD)), None

    def _forward_farskip(
        self,
        stream: FarSkipStream,
        cache: LayerCache | None,
        visible_BSS: torch.Tensor | None,
        padding_BS: torch.Tensor | None,
    ) -> tuple[FarSkipStream, MoEStats | None]:
        """The attention on the stream as it has arrived, while the previous FFN output may still travel; then
        that output joins, and this block's FFN starts, its output left in flight for the next block."""
        attended_BSD = self.attn(self.attn_norm(stream.arrived_BSD), cache, visible_BSS)
        h_BSD = stream.joined() + attended_BSD
        if isinstance(self.ffn, MoELayer):
            late, stats = self.ffn.start(self.ffn_norm(h_BSD), padding_BS)
            return FarSkipStream(h_BSD, late), stats
        return FarSkipStream(h_BSD, LateOutput.ready(self.ffn(self.ffn_norm(h_BSD)))), None


class AbsentBlock(nn.Module):
    """The place of a block another pipeline stage holds: no parameters, so the model's state_dict keeps the
    logical names of the blocks this rank holds (`layers.<index>.`) and nothing of the others."""

    ffn = None


class Transformer(nn.Module):
    """Decoder-only MoE language model; the first `dense_layers` blocks use a dense FFN.

    `kernels` fixes the implementation of every kernel op for the model's lifetime
    (chosen for the device it will run on); without one, every op is portable. `recompute` is what every block
    keeps for its backward (`train.activation_checkpointing`, `ferry/model/recompute.py`).
    """

    def __init__(
        self,
        config: ModelConfig,
        kernels: KernelSelection | None = None,
        initialise: bool = True,
        recompute: Recompute = "none",
        track_max_logits: bool = False,
    ):
        """`track_max_logits`: every attention keeps each head's largest logit of the training forwards
        (`ferry/model/max_logit.py`)."""
        super().__init__()
        self.config = config
        self.skip = config.skip_kind
        self.kernels = kernels or portable_kernels()
        rope = RotaryEmbedding(config.rope_dim, config.max_seq_len, config.rope_theta, config.rope_scaling)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(
            Block(
                config,
                rope,
                index >= config.dense_layers,
                self.kernels,
                recompute,
                track_max_logits,
                config.attention_window(index),
            )
            for index in range(config.n_layers)
        )
        self.norm = RMSNorm(config.dim, config.norm_eps, self.kernels)
        self.output = Linear(config.dim, config.vocab_size, self.kernels)
        mtp_moe = config.n_layers > config.dense_layers  # a module's block is MoE where the model's last is
        with torch.random.fork_rng(devices=[]):  # built without moving the generator: the model draws as without
            self.mtp = nn.ModuleList(
                MTPModule(config, Block(config, rope, mtp_moe, self.kernels, recompute), self.kernels)
                for _ in range(config.mtp.depth)
            )
        self.sequence_split: SequenceSplit | None = None
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if initialise:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, progress: Callable[[], None] = lambda: None) -> None:
        """Normal(0, init_std) everywhere; residual output projections scaled by 1/sqrt(2 * n_layers); biases and
        attention sinks zero (a sink at zero starts as one more key of zero logit).

        `progress` is called after each parameter: a draw of billions takes minutes on the host, and
        whoever watches for hangs can tell it is still moving.
        """
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif is_bias(name):
                param.zero_()
            elif name.endswith(("wo.weight", "w_down.weight", "w_down_EDF")):
                truncated_normal_(param, std=residual_std, bound=3 * residual_std)
            else:
                truncated_normal_(param, std=std, bound=3 * std)
            progress()
        for module in self.modules():
            if hasattr(module, "expert_bias_E"):
                module.expert_bias_E.zero_()

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers this model holds (under pipeline parallelism, those of its own stages), its MTP modules'
        last."""
        return list(self.moe_layers_by_index().values())

    def moe_layers_by_index(self) -> dict[int, MoELayer]:
        """The MoE layers held, by their index among all the model's MoE layers (the rows of the step's loads;
        the MTP modules' follow the model's)."""
        first = self.config.dense_layers
        held = {index - first: block.ffn for index, block in enumerate(self.layers) if isinstance(block.ffn, MoELayer)}
        main = self.config.n_layers - first
        held.update(
            {
                main + depth: module.block.ffn
                for depth, module in enumerate(self.mtp)
                if isinstance(module.block.ffn, MoELayer)
            }
        )
        return held

    def held_blocks(self) -> list[int]:
        """The indices of the blocks this model holds (under pipeline parallelism, its own stages')."""
        return [index for index, block in enumerate(self.layers) if not isinstance(block, AbsentBlock)]

    def keep_only(self, blocks: set[int], embedding: bool, head: bool) -> None:
        """Drop what other pipeline stages hold: the blocks not in `blocks`, the embedding and the final norm and
        head unless asked to keep them. Drawn first on every rank, the kept weights are the single process's."""
        for index in range(len(self.layers)):
            if index not in blocks:
                self.layers[index] = AbsentBlock()
        if not embedding:
            self.tok_embeddings = None
        if not head:
            self.norm = None
            self.output = None

    def split_sequences(self, split: SequenceSplit) -> None:
        """Compute this rank's positions of every sequence (context parallelism): the model splits its inputs,
        every attention gathers the keys of the whole sequence, every router makes its means whole."""
        self.sequence_split = split
        for block in self.layers:
            if isinstance(block, Block):
                block.attn.sequence_split = split
                if isinstance(block.ffn, MoELayer):
                    block.ffn.router.sequence_split = split

    @staticmethod
    def visibility(document_ids_BS: torch.Tensor | None) -> torch.Tensor | None:
        """Which earlier positions each position attends to within its document (None: plain causal)."""
        if document_ids_BS is None:
            return None
        same_BSS = document_ids_BS[:, :, None] == document_ids_BS[:, None, :]
        return same_BSS.tril()

    def forward(
        self,
        tokens_BS: torch.Tensor,
        cache: KVCache | None = None,
        document_ids_BS: torch.Tensor | None = None,
        padding_BS: torch.Tensor | None = None,
        targets: HeadTargets | None = None,
    ) -> ModelOutput:
        """Logits of every position; with a cache, `tokens_BS` continue what it holds and are added to it.

        With `document_ids_BS` (the document of each position of a packed sequence), a
        position attends only to earlier positions of its own document. `padding_BS` marks the
        positions that only pad their row: computed like the others, left out of the routers'
        losses and statistics. With `targets`, the output projection and the cross-entropy are
        computed together chunk by chunk (`head_loss.py`) and no logits are returned: inside the
        forward, where a sharded head's weight is gathered.
        """
        if tokens_BS.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {tokens_BS.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")
        if cache is not None and document_ids_BS is not None:
            raise ValueError("decoding with a cache attends to every cached token; document masking is for training")
        step = cache.begin(tokens_BS.shape[1]) if cache is not None else None
        split = self.sequence_split if cache is None else None
        if split is None:
            visible_BSS = self.visibility(document_ids_BS)
        else:
            tokens_BS, padding_BS, targets, visible_BSS = self.own_positions(
                split, tokens_BS, document_ids_BS, padding_BS, targets
            )
        x_BSD = self.tok_embeddings(tokens_BS)
        stream = self.skip.stream(x_BSD)
        moe_stats = []
        for index, block in enumerate(self.layers):
            layer_cache = cache.layer(index, step) if cache is not None else None
            stream, stats = block(stream, layer_cache, visible_BSS, padding_BS)
            if stats is not None:
                moe_stats.append(stats)
        if cache is not None:
            cache.commit(step)
        h_BSD = self.norm(self.skip.joined(stream))
        if targets is not None:
            mtp_losses = self._mtp_losses(
                tokens_BS, h_BSD, targets, document_ids_BS, visible_BSS, padding_BS, moe_stats
            )
            head_loss = chunked_head_loss(h_BSD, self.output.weight, targets)
            return ModelOutput(None, moe_stats, head_loss, split, mtp_losses)
        return ModelOutput(self.output(h_BSD), moe_stats, split=split)

    def _mtp_losses(
        self,
        tokens_BS: torch.Tensor,
        h_BSD: torch.Tensor,
        targets: HeadTargets,
        document_ids_BS: torch.Tensor | None,
        visible_BSS: torch.Tensor | None,
        padding_BS: torch.Tensor | None,
        moe_stats: list[MoEStats],
    ) -> list[HeadLoss]:
        """Each MTP module's loss against the targets it predicts (`ferry/model/mtp.py`), its MoE statistics added
        to `moe_stats`."""
        losses = []
        for depth, module in enumerate(self.mtp, start=1):
            h_BSD, stats = module(self.tok_embeddings(ahead(tokens_BS, depth, 0)), h_BSD, visible_BSS, padding_BS)
            if stats is not None:
                moe_stats.append(stats)
            ahead_targets = HeadTargets(targets_ahead(targets.targets_BS, depth, document_ids_BS), targets.chunk_tokens)
            losses.append(chunked_head_loss(h_BSD, self.output.weight, ahead_targets))
        return losses

    @torch.no_grad()
    def mtp_logits(self, tokens_BS: torch.Tensor) -> list[torch.Tensor]:
        """Each MTP module's logits over `tokens_BS` (module k at position i: of token i + k + 1), its last k
        positions read past the row (their logits mean nothing); plain causal attention, no cache."""
        x_BSD = self.tok_embeddings(tokens_BS)
        stream = self.skip.stream(x_BSD)
        for block in self.layers:
            stream, _ = block(stream)
        h_BSD = self.norm(self.skip.joined(stream))
        logits = []
        for depth, module in enumerate(self.mtp, start=1):
            h_BSD, _ = module(self.tok_embeddings(ahead(tokens_BS, depth, 0)), h_BSD, None, None)
            logits.append(self.output(h_BSD))
        return logits

    @staticmethod
    def own_positions(
        split: SequenceSplit,
        tokens_BS: torch.Tensor,
        document_ids_BS: torch.Tensor | None,
        padding_BS: torch.Tensor | None,
        targets: HeadTargets | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, HeadTargets | None, torch.Tensor]:
        """This rank's positions of the inputs (`SequenceSplit`; padded to whole chunks, the padding's targets not
        trained), and which gathered keys each of them sees."""
        rows, seq_len = tokens_BS.shape
        padding_BL, visible_BLS = split.own_masks(rows, seq_len, tokens_BS.device, document_ids_BS, padding_BS)
        if targets is not None:
            targets = HeadTargets(split.local(targets.targets_BS, IGNORE_INDEX), targets.chunk_tokens)
        return split.local(tokens_BS, 0), padding_BL, targets, visible_BLS

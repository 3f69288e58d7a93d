"""Model variants as kinds: the attention (`model.attention`) and the skip wiring (`model.skip`), one kind a file.

Each kind answers every question the rest of ferry would otherwise ask by comparing the variant's name: its
module, its parameters and FLOPs, what a token keeps for the backward, its decoding cache, its transformers
mapping and what an export to a transformers architecture refuses. The config keeps its literals; the kind is
looked up once, from them (`ModelConfig.attention_kind`, `ModelConfig.skip_kind`).
"""

from ferry.model.variants.base import AttentionKind, SkipKind
from ferry.model.variants.registry import ATTENTION_KINDS, SKIP_KINDS

__all__ = ["ATTENTION_KINDS", "SKIP_KINDS", "AttentionKind", "SkipKind"]

"""The kinds by the config literal that names them (`model.attention`, `model.skip`)."""

from __future__ import annotations

from ferry.model.variants.base import AttentionKind, SkipKind
from ferry.model.variants.farskip import FarSkipWiring
from ferry.model.variants.gqa import GroupedQueryAttention
from ferry.model.variants.mla import MultiHeadLatentAttention
from ferry.model.variants.standard import StandardWiring

ATTENTION_KINDS: dict[str, AttentionKind] = {
    kind.name: kind for kind in (GroupedQueryAttention(), MultiHeadLatentAttention())
}
SKIP_KINDS: dict[str, SkipKind] = {kind.name: kind for kind in (StandardWiring(), FarSkipWiring())}

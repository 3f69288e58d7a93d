"""Which parameters are biases: vectors per output (or per head) that neither decay nor take Muon's orthogonal
update, whatever their number of dimensions (an expert's bias is a matrix: one row per expert)."""

from __future__ import annotations

BIAS_PREFIXES = ("bias", "sinks")  # nn.Linear's `bias`, the experts' `bias_*_E?`, attention's `sinks_H`


def is_bias(name: str) -> bool:
    """`name` (a dotted parameter name) is a bias or an attention sink."""
    return name.rsplit(".", 1)[-1].startswith(BIAS_PREFIXES)

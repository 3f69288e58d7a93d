"""Data configuration: a weighted mix of prepared token datasets."""

from __future__ import annotations

from pydantic import Field, field_validator

from ferry.config.section import Section, check_unique_names
from ferry.data.verification import DataVerification


class SourceConfig(Section):
    """One prepared dataset (a directory written by `ferry data prepare`) and its share of each batch."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    weight: float = Field(1.0, gt=0.0)


class DataConfig(Section):
    """What the model reads: sources with weights, cut into windows of `seq_len` tokens."""

    sources: list[SourceConfig] = Field(
        default_factory=lambda: [SourceConfig(name="stdlib", path="data/stdlib")], min_length=1
    )
    seq_len: int = Field(256, ge=1)
    document_masking: bool = Field(
        False, description="attend only within each document of a packed window (documents end with end-of-text)"
    )
    verify: DataVerification = Field(
        "xxh3_128",
        description="the digest of every file of the sources checked against their manifests before the run reads "
        "them (xxh3_128: ~8 GB/s a core; sha256 where the manifests are kept out of a forger's reach; none for a "
        "mix so large that hashing it on every start costs more than it saves); held-out sources are always checked",
    )

    @field_validator("sources")
    @classmethod
    def _names_unique(cls, sources: list[SourceConfig]) -> list[SourceConfig]:
        check_unique_names(sources, "source")
        return sources

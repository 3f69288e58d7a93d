"""Data configuration: a weighted mix of prepared token datasets, each with an optional budget."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from ferry.config.section import Section, check_unique_names
from ferry.data.verification import DataVerification


class SourceConfig(Section):
    """One prepared dataset (a directory written by `ferry data prepare`) and its share of each batch."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    weight: float = Field(1.0, gt=0.0)
    tokens: int | None = Field(
        None,
        gt=0,
        description="a budget: read this many tokens of the source (rounded down to whole windows of data.seq_len), "
        "repeating it past its end if it holds fewer, then leave the mix; its rows go to the other sources by weight",
    )
    epochs: float | None = Field(
        None,
        gt=0.0,
        description="a budget: read the source this many times over (2: every window twice, each pass in its own "
        "order; 0.5: half its windows), then leave the mix; its rows go to the other sources by weight",
    )

    @model_validator(mode="after")
    def _one_budget(self) -> SourceConfig:
        if self.tokens is not None and self.epochs is not None:
            raise ValueError(
                f"source {self.name!r} sets both tokens ({self.tokens}) and epochs ({self.epochs}): each is a budget "
                "of the source; keep one"
            )
        return self


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
        "them (xxh3_128: ~8 GB/s a core; sha256 where the manifests are kept out of a forger's reach; none to read "
        "them unchecked, where `ferry data verify` checks them apart); held-out sources are always checked",
    )
    verify_upfront: int = Field(
        1 << 30,
        ge=0,
        description="a mix whose files add up to at most this many bytes (each file counted as at least 1 MiB, about "
        "what opening one costs on a network file system) is checked whole before the run starts, so a changed file "
        "is refused before the run directory is touched; a larger mix is checked shard by shard when each is first "
        "read, before any of its tokens is, so a run over 10,000 shards starts without reading them (0: always so)",
    )

    @field_validator("sources")
    @classmethod
    def _names_unique(cls, sources: list[SourceConfig]) -> list[SourceConfig]:
        check_unique_names(sources, "source")
        return sources

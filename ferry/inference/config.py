"""What generation and held-out evaluation are asked to do: sections a run config (or a later stage) embeds."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ferry.config.section import Section, check_unique_names


class GenerationConfig(Section):
    """Sampling as inference servers offer it: temperature 0 is greedy; top-k and top-p filter before sampling."""

    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy (argmax)")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens; 0 = all")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="sample among the smallest set holding this probability")
    seed: int = Field(0, ge=0, description="the sampling generator's seed: the same seed gives the same tokens")
    stop: list[str] = Field(default_factory=list, description="strings that end a completion (besides EOS)")
    latent_decoding: Literal["auto", "absorbed", "expanded"] = Field(
        "auto",
        description="MLA: attend over the cached latents with the up-projections absorbed (per-token work grows "
        "with kv_lora_rank), over keys and values expanded from them, or whichever takes fewer multiply-adds "
        "for a step's shape (absorbed for decoding, expanded for a long prompt)",
    )

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, stop: list[str]) -> list[str]:
        if any(not text for text in stop):
            raise ValueError("a stop string must not be empty")
        return stop


class HeldOutSource(Section):
    """A prepared dataset (`ferry data prepare`) the model never trains on."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)


class EvalConfig(Section):
    """Held-out loss during training: the same windows of each source every time, so the curve is comparable."""

    sources: list[HeldOutSource] = Field(default_factory=list, description="none: no evaluation")
    interval: int = Field(0, ge=0, description="evaluate every N steps; 0 = only after the last step")
    batches: int = Field(4, ge=1, description="batches per source per evaluation")
    batch_size: int | None = Field(
        None, ge=1, description="sequences per batch, over all ranks; default train.global_batch"
    )

    @field_validator("sources")
    @classmethod
    def _names_unique(cls, sources: list[HeldOutSource]) -> list[HeldOutSource]:
        check_unique_names(sources, "held-out source")
        return sources

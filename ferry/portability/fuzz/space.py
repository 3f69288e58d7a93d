"""What the layout fuzzer draws: one value per axis, each axis a setting a user changes.

Every layout is meant to be the same computation, so a combination splits in two: the **computation** (the
model's kinds and parts, the optimizer, the kernel policy, the data's masking, the sequences of a forward) and the
**layout** (how many ranks, which parallelism, recomputation, overlap and dispatch of the expert exchange). The
oracle of a combination is its
computation on one process with the default layout; combinations that share a computation share their oracle.
A draw is a function of (seed, index) alone, so a failure replays from those two numbers.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

# axis -> {value: overrides}; the first value of each axis is the one-process default
COMPUTATION: dict[str, dict[str, tuple[str, ...]]] = {
    "attention": {
        "gqa": (),
        "mla": ("model.attention=mla", "model.n_kv_heads=4",
                "model.mla={q_lora_rank: 16, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, "
                "v_head_dim: 8}"),
    },
    "dense_layers": {"1": ("model.dense_layers=1",), "0": ("model.dense_layers=0",)},
    "shared_expert": {"none": (), "32": ("model.moe.shared_expert_ffn_dim=32",)},
    "routing": {"softmax": (), "sigmoid-groups": ("model.moe.score_func=sigmoid", "model.moe.n_group=2",
                                                  "model.moe.topk_group=1", "model.moe.renormalize=true")},
    "skip": {"standard": (), "farskip": ("model.skip=farskip",)},
    "optimizer": {"adamw": (), "muon": ("optim.name=muon",)},
    "kernels": {"auto": (), "portable": ("kernels.policy=portable",)},
    "documents": {"whole": (), "masked": ("data.document_masking=true",)},
    "mtp": {"none": (), "1": ("model.mtp.depth=1",)},
    # the sequences a forward holds: the routers' balancing loss is a function of them, so it is the computation's
    "micro_batch": {"4": (), "2": ("train.micro_batch=2",), "8": ("train.micro_batch=8",)},
}
LAYOUT: dict[str, dict[str, tuple[str, ...]]] = {
    "world": {"1": (), "2": (), "4": ()},
    "parallel": {
        "single": (),
        "ep": ("parallel.ep=WORLD",),
        "ep-zero": ("parallel.ep=WORLD", "optim.zero=true"),
        "dp-zero": ("optim.zero=true",),
        "fsdp": ("parallel.mode=fsdp",),
        "pp": ("parallel.pp=2",),
        "pp-ep": ("parallel.pp=2", "parallel.ep=HALF"),
        "cp": ("parallel.cp=2",),
    },
    "recompute": {"none": (), "selective": ("train.activation_checkpointing=selective",),
                  "full": ("train.activation_checkpointing=full",)},
    "ep_exchange": {"single": (), "chunked": ("parallel.ep_overlap=chunked",),
                    "rowwise": ("parallel.ep_dispatch=rowwise",)},
}


@dataclass(frozen=True)
class Combination:
    """One draw: a value for every axis."""

    values: tuple[tuple[str, str], ...]

    def __getitem__(self, axis: str) -> str:
        return dict(self.values)[axis]

    @property
    def world(self) -> int:
        return int(self["world"])

    def overrides(self) -> list[str]:
        """The run config overrides that set it (the placeholders WORLD and HALF: the ranks, half of them)."""
        chosen = dict(self.values)
        found = []
        for axis, values in (*COMPUTATION.items(), *LAYOUT.items()):
            found += [override.replace("WORLD", str(self.world)).replace("HALF", str(max(self.world // 2, 1)))
                      for override in values[chosen[axis]]]
        return found

    def computation(self) -> Combination:
        """The oracle's combination: this computation, on one process with the default layout."""
        chosen = dict(self.values)
        return Combination(tuple((axis, chosen[axis] if axis in COMPUTATION else next(iter(LAYOUT[axis])))
                                 for axis, _ in self.values))

    def digest(self) -> str:
        """The combination's identity in a report: sha256 of its values (12 hex digits)."""
        return hashlib.sha256(json.dumps(self.values).encode()).hexdigest()[:12]

    def describe(self) -> str:
        return " ".join(f"{axis}={value}" for axis, value in self.values)


ONE_PROCESS = ("single", "ep", "ep-zero", "dp-zero", "fsdp")  # the parallel values a single process can take


def draw(seed: int, index: int) -> Combination:
    """Combination `index` of the stream `seed`: each axis's value uniformly, from its own generator; on one
    process, the parallelism among those one process has (a pipeline or a split sequence needs two ranks, and
    is refused on one without telling anything)."""
    generator = random.Random(f"{seed}:{index}")
    axes = {**COMPUTATION, **LAYOUT}
    values = {axis: generator.choice(list(choices)) for axis, choices in axes.items()}
    if values["world"] == "1" and values["parallel"] not in ONE_PROCESS:
        values["parallel"] = generator.choice(ONE_PROCESS)
    return Combination(tuple(values.items()))


def named(text: str) -> Combination:
    """A combination from `axis=value` words (`describe`'s form); unnamed axes take their default."""
    given = dict(word.split("=", 1) for word in text.split())
    axes = {**COMPUTATION, **LAYOUT}
    unknown = sorted(set(given) - set(axes))
    if unknown:
        raise ValueError(f"unknown axes {unknown}; axes: {', '.join(axes)}")
    for axis, value in given.items():
        if value not in axes[axis]:
            raise ValueError(f"{axis}={value}: values are {', '.join(axes[axis])}")
    return Combination(tuple((axis, given.get(axis, next(iter(values)))) for axis, values in axes.items()))

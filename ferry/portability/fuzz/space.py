"""What the layout fuzzer draws: one value per axis, each axis a setting a user changes.

Every layout is meant to be the same computation, so a combination splits in two: the **computation** (the
objective and its data, the compute precision, the model's depth, kinds and parts, the optimizer, the kernel
policy, the data's masking, the sequences of a forward) and the **layout** (how many ranks, which parallelism and
pipeline schedule, recomputation, overlap and dispatch of the expert exchange). The oracle of a combination is its
computation on one process with the default layout; combinations that share a computation share their oracle.
A draw is a function of (seed, index) alone, so a failure replays from those two numbers.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

from ferry.parallel.optimizers import DEFAULT_OPTIMIZER, OPTIMIZER_KINDS

# axis -> {value: overrides}; the first value of each axis is the one-process default
COMPUTATION: dict[str, dict[str, tuple[str, ...]]] = {
    # what a step optimises, on the data it reads (the placeholders: `FuzzData`'s datasets, and PARENT, the SFT
    # checkpoint of the same model that DPO and GRPO start from and take as their reference)
    "objective": {
        "lm": ("data.sources=[{name: text, path: TEXT}]",),
        "sft": ("data.sources=[{name: chat, path: CHAT}]", "data.seq_len=64"),
        "dpo": (
            "train.objective=dpo",
            "data.sources=[{name: pairs, path: PAIRS}]",
            "data.seq_len=64",
            "init_from=PARENT",
        ),
        "grpo": (
            "train.objective=grpo",
            "data.sources=[{name: prompts, path: PROMPTS}]",
            "data.seq_len=64",
            "grpo.group_size=4",
            "grpo.max_new_tokens=3",
            "grpo.verifier=numeric",
            "init_from=PARENT",
        ),
    },
    "precision": {"fp32": (), "bf16": ("precision.compute_dtype=bf16",)},
    "layers": {"2": (), "4": ("model.n_layers=4",)},
    "attention": {
        "gqa": (),
        "mla": (
            "model.attention=mla",
            "model.n_kv_heads=4",
            "model.mla={q_lora_rank: 16, kv_lora_rank: 16, qk_nope_head_dim: 8, qk_rope_head_dim: 8, v_head_dim: 8}",
        ),
        # GPT-OSS's: biased projections, a sink logit a head, every other layer windowed
        "gqa-sinks-window": (
            "model.attention_bias=true",
            "model.attention_sinks=true",
            "model.sliding_window=16",
            "model.sliding_window_pattern=2",
        ),
    },
    "experts": {
        "plain": (),
        "biased-clamped": (
            "model.moe.router_bias=true",
            "model.moe.expert_biases=true",
            "model.moe.activation=clamped_swiglu",
        ),
    },
    "dense_layers": {"1": ("model.dense_layers=1",), "0": ("model.dense_layers=0",)},
    "shared_expert": {"none": (), "32": ("model.moe.shared_expert_ffn_dim=32",)},
    "routing": {
        "softmax": (),
        "sigmoid-groups": (
            "model.moe.score_func=sigmoid",
            "model.moe.n_group=2",
            "model.moe.topk_group=1",
            "model.moe.renormalize=true",
        ),
    },
    "skip": {"standard": (), "farskip": ("model.skip=farskip",)},
    # every optimizer kind, the default first (ferry/parallel/optimizers/)
    "optimizer": {
        name: () if name == DEFAULT_OPTIMIZER else (f"optim.name={name}",)
        for name in sorted(OPTIMIZER_KINDS, key=lambda name: name != DEFAULT_OPTIMIZER)
    },
    "kernels": {"auto": (), "portable": ("kernels.policy=portable",)},
    "documents": {"whole": (), "masked": ("data.document_masking=true",)},
    "mtp": {"none": (), "1": ("model.mtp.depth=1",)},
    # the sequences a forward holds: the routers' balancing loss is a function of them, so it is the computation's
    "micro_batch": {"4": (), "2": ("train.micro_batch=2",), "8": ("train.micro_batch=8",)},
}
LAYOUT: dict[str, dict[str, tuple[str, ...]]] = {
    "world": {"1": (), "2": (), "4": (), "8": ()},
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
    # a pipeline's schedule (1f1b with any other parallelism, where it means nothing)
    "schedule": {
        "1f1b": (),
        "gpipe": ("parallel.pp_schedule=gpipe",),
        "interleaved": ("parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"),
        "looped": ("parallel.pp_schedule=looped_bfs", "parallel.pp_virtual_stages=2"),
    },
    "recompute": {
        "none": (),
        "selective": ("train.activation_checkpointing=selective",),
        "full": ("train.activation_checkpointing=full",),
    },
    "ep_exchange": {
        "single": (),
        "chunked": ("parallel.ep_overlap=chunked",),
        "rowwise": ("parallel.ep_dispatch=rowwise",),
        # the EP group as two simulated nodes (NODE: half its ranks), a token sent to each once
        "hierarchical": ("parallel.ep_topology=hierarchical", "parallel.ranks_per_node=NODE"),
    },
}
EXPERTS_SPLIT = {"ep": 1, "ep-zero": 1, "pp-ep": 2}  # the parallel values that split experts: world / this ranks


@dataclass(frozen=True)
class Combination:
    """One draw: a value for every axis."""

    values: tuple[tuple[str, str], ...]

    def __getitem__(self, axis: str) -> str:
        return dict(self.values)[axis]

    @property
    def world(self) -> int:
        return int(self["world"])

    @property
    def ep(self) -> int:
        """The ranks its experts are split over (1 where its parallelism does not split them)."""
        return self.world // EXPERTS_SPLIT[self["parallel"]] if self["parallel"] in EXPERTS_SPLIT else 1

    def overrides(self) -> list[str]:
        """The run config overrides that set it (the placeholders WORLD, HALF and NODE: the ranks, half of them,
        half of the EP group's)."""
        chosen = dict(self.values)
        places = {"WORLD": self.world, "HALF": max(self.world // 2, 1), "NODE": max(self.ep // 2, 1)}
        found = []
        for axis, values in (*COMPUTATION.items(), *LAYOUT.items()):
            for override in values[chosen[axis]]:
                for name, count in places.items():
                    override = override.replace(name, str(count))
                found.append(override)
        return found

    def profile(self) -> str:
        """The tolerance profile (`tolerances.yaml`) its steps are judged under against its oracle: `sampled` for
        an objective that draws its own data, `layout-bf16` for bf16 compute, `layout` otherwise."""
        if self["objective"] == "grpo":
            return "sampled"
        return "layout-bf16" if self["precision"] == "bf16" else "layout"

    def computation(self) -> Combination:
        """The oracle's combination: this computation, on one process with the default layout."""
        chosen = dict(self.values)
        return Combination(
            tuple((axis, chosen[axis] if axis in COMPUTATION else next(iter(LAYOUT[axis]))) for axis, _ in self.values)
        )

    def digest(self) -> str:
        """The combination's identity in a report: sha256 of its values (12 hex digits)."""
        return hashlib.sha256(json.dumps(self.values).encode()).hexdigest()[:12]

    def describe(self) -> str:
        return " ".join(f"{axis}={value}" for axis, value in self.values)


ONE_PROCESS = ("single", "ep", "ep-zero", "dp-zero", "fsdp")  # the parallel values a single process can take
PIPELINES = ("pp", "pp-ep")
TWO_STAGES_A_RANK = ("interleaved", "looped")  # 4 stages over 2 ranks: a block each needs 4 layers
NEXT_TOKEN = ("lm", "sft")  # the objectives MTP's modules train with


def draw(seed: int, index: int) -> Combination:
    """Combination `index` of the stream `seed`: each axis's value uniformly, from its own generator, then made
    to mean something, where a value would otherwise be refused or ignored without telling anything:
    - on one process, the parallelism among those one process has (a pipeline or a split sequence needs two);
    - a schedule only with a pipeline (1f1b, the default, otherwise), and two stages a rank on 4 layers (2 layers
      have too few blocks for 4 stages);
    - MTP only with a next-token objective: it is a pre-training aid, which a DPO or GRPO stage is refused
      with by name (`tests/test_mtp.py`), so a draw of it there would measure one known refusal again;
    - the hierarchical exchange only where experts are split over 2 ranks or more (its two nodes need them)."""
    generator = random.Random(f"{seed}:{index}")
    axes = {**COMPUTATION, **LAYOUT}
    values = {axis: generator.choice(list(choices)) for axis, choices in axes.items()}
    if values["world"] == "1" and values["parallel"] not in ONE_PROCESS:
        values["parallel"] = generator.choice(ONE_PROCESS)
    if values["parallel"] not in PIPELINES:
        values["schedule"] = "1f1b"
    elif values["schedule"] in TWO_STAGES_A_RANK:
        values["layers"] = "4"
    if values["objective"] not in NEXT_TOKEN:
        values["mtp"] = "none"
    if values["ep_exchange"] == "hierarchical" and Combination(tuple(values.items())).ep < 2:
        values["ep_exchange"] = "single"
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

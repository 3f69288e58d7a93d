"""The one table of per-step metrics: record key, exported Prometheus name, shape, help.

Every sink reads this table, `docs/metrics.md` documents it, and the Grafana
dashboard may query only the Prometheus names in it (a test checks both), so a
metric is renamed in one place or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

METRICS_FILE = "metrics.jsonl"
RUN_RECORD_FILE = "run.json"  # the run's record (`ferry/train/run_dir/record.py`), which the trackers upload
TRACKER_IDS_FILE = "trackers.json"  # each tracker's run id, so that a resumed run continues it
# the directories of a run's records beside its metrics: `ferry plot`'s PNGs, TensorBoard's event files and the
# torch traces; a run that replaces another (`run.overwrite`) replaces them with its records
PLOT_DIR = "plots"
TENSORBOARD_DIR = "tensorboard"
TRACE_DIR = "traces"
RECORD_DIRS = (PLOT_DIR, TENSORBOARD_DIR, TRACE_DIR)

Shape = Literal["step", "layer", "expert", "source", "stage", "depth"]


@dataclass(frozen=True)
class Metric:
    """`shape`: one number per step, a list over MoE layers, a list over layers of lists over experts, a
    mapping from held-out source name to a number (only in the records of steps that evaluated), a list over
    pipeline stages (only in the records of pipeline-parallel runs), or a mapping from multi-token-prediction
    depth ("1", "2", ...) to a number (only with `model.mtp.depth`).

    `scale` turns the record's unit into the exported one (Prometheus wants base units: bytes, not MiB).
    `objective`: the `train.objective` whose steps report it (None: every objective's). `pipeline`: reported by
    pipeline-parallel runs only. `opt_in`: reported by runs that ask for it only (a figure, or the layout it
    measures: `parallel.cp`).
    """

    key: str
    prometheus: str
    shape: Shape
    help: str
    scale: float = 1.0
    objective: str | None = None
    pipeline: bool = False
    opt_in: bool = False


def _step(key: str, prometheus: str, help: str, scale: float = 1.0, objective: str | None = None) -> Metric:
    return Metric(key, f"ferry_{prometheus}", "step", help, scale, objective)


def _dpo(key: str, prometheus: str, help: str) -> Metric:
    return _step(key, f"dpo_{prometheus}", f"DPO: {help}", objective="dpo")


def _grpo(key: str, prometheus: str, help: str) -> Metric:
    return _step(key, f"grpo_{prometheus}", f"GRPO: {help}", objective="grpo")


def _moe(name: str, help: str, aggregate: str) -> tuple[Metric, Metric]:
    """An MoE diagnostic as the aggregate over layers and as one value per layer."""
    return (
        Metric(f"moe.{name}", f"ferry_moe_{name}", "step", f"{help} ({aggregate} over MoE layers)"),
        Metric(f"moe.{name}_per_layer", f"ferry_moe_layer_{name}", "layer", f"{help}, per MoE layer"),
    )


METRICS: tuple[Metric, ...] = (
    _step("step", "step", "optimizer steps completed"),
    _step("tokens", "tokens_seen", "tokens trained on since the run began"),
    _step("loss", "loss", "training objective: lm_loss + aux_loss_coef * aux_loss + z_loss_coef * z_loss"),
    _step("lm_loss", "lm_loss", "next-token cross-entropy, mean over the step's trained tokens", objective="lm"),
    _step("token_accuracy", "token_accuracy", "share of trained tokens the model ranks first", objective="lm"),
    _step(
        "trained_share",
        "trained_share",
        "trained tokens / tokens of the step (below 1 with a loss mask: SFT)",
        objective="lm",
    ),
    _step("aux_loss", "aux_loss", "load-balancing loss as optimised (1.0 at perfect balance)"),
    _step("z_loss", "z_loss", "router z-loss"),
    _step("lr", "learning_rate", "learning rate of the step"),
    _step("grad_norm", "grad_norm", "global gradient norm before clipping"),
    _step("step_s", "step_seconds", "wall-clock time of the step"),
    _step("forward_s", "forward_seconds", "time in forward passes"),
    _step("backward_s", "backward_seconds", "time in backward passes"),
    _step("optimizer_s", "optimizer_seconds", "time in clipping and the optimizer update"),
    _step("generate_s", "generate_seconds", "time sampling completions (GRPO rollouts; 0 for other objectives)"),
    _step("compute_s", "compute_seconds", "forward + backward + optimizer + generate time not blocked in comms"),
    _step("comm_s", "comm_seconds", "time blocked in collectives"),
    _step("comm_compute_ratio", "comm_compute_ratio", "comm_s / compute_s"),
    _step("ep_wait_s", "ep_wait_seconds", "time blocked in MoE dispatch and combine: the exposed part of ep_comm_s"),
    _step(
        "ep_comm_s", "ep_comm_seconds", "time the forward's MoE exchanges (counts, dispatch, combine) were in flight"
    ),
    _step(
        "ep_exchanges",
        "ep_exchanges",
        "MoE exchanges (counts, dispatch, combine) the step's forwards issued: more when chunked or rowwise",
    ),
    _step(
        "ep_overlap_share",
        "ep_overlap_share",
        "share of ep_comm_s the rank computed through: 1 - ep_wait_s / ep_comm_s (0 with ep_overlap: none)",
    ),
    _step("tokens_per_s", "tokens_per_second", "tokens of the step over all devices / step_s"),
    _step("tokens_per_s_per_device", "tokens_per_second_per_device", "tokens_per_s / devices"),
    _step("mfu", "mfu", "model FLOPs utilisation against the hardware profile's peak for the dtype in use"),
    _step("mem_peak_mib", "memory_peak_bytes", "peak memory of the process since it started (bytes)", 2**20),
    _step("comm_bytes", "comm_bytes", "bytes handed to collectives by rank 0 in the step"),
    _step(
        "intra_node_bytes",
        "intra_node_bytes",
        "bytes rank 0 sent in the step to ranks of its node (an all-to-all's rows by their destination; another "
        "collective's in the widest tier of its group)",
    ),
    _step("inter_node_bytes", "inter_node_bytes", "bytes rank 0 sent in the step to ranks of other nodes (as above)"),
    _step("intra_node_comm_s", "intra_node_comm_seconds", "time of rank 0's collectives whose groups lie in one node"),
    _step("inter_node_comm_s", "inter_node_comm_seconds", "time of rank 0's collectives whose groups span nodes"),
    _step("optimizer_state_mib", "optimizer_state_bytes", "optimizer state held by rank 0 (ZeRO-1 shrinks it)", 2**20),
    _step("loss_scale", "loss_scale", "current loss scale (1 without loss scaling)"),
    _step("skipped_steps", "skipped_steps", "steps skipped so far because gradients overflowed"),
    _step(
        "checkpoint.blocked_s",
        "checkpoint_blocked_seconds",
        "time training waited for checkpoint saves in the step (the snapshot, a synchronous write, a save in flight)",
    ),
    _step(
        "checkpoint.write_s",
        "checkpoint_write_seconds",
        "time this rank took to write the saves that ended in the step (in the background when asynchronous)",
    ),
    _step("checkpoint.failed_saves", "checkpoint_failed_saves", "saves the storage refused so far in this attempt"),
    _step("checkpoint_interval_steps", "checkpoint_interval_steps", "steps between checkpoints (Young/Daly when auto)"),
    _step("goodput", "goodput", "productive step time over the job's wall time so far, restarts included"),
    _step("lost_steps", "lost_steps", "steps trained again after failures, since the job began (rank 0)"),
    _step("loading_s", "loading_seconds", "time verifying and restoring checkpoints since the job began (rank 0)"),
    _step("restarting_s", "restarting_seconds", "time from failures to restored restarts since the job began"),
    Metric(
        "pp.bubble",
        "ferry_pipeline_bubble",
        "step",
        "share of the pipeline schedule's time a rank was not computing, mean over the pipeline's ranks",
        pipeline=True,
    ),
    Metric(
        "pp.schedule_s",
        "ferry_pipeline_schedule_seconds",
        "step",
        "time rank 0 spent in the pipeline schedule",
        pipeline=True,
    ),
    Metric(
        "pp.stage_busy_s",
        "ferry_pipeline_stage_busy_seconds",
        "stage",
        "forward and backward compute time of each pipeline stage in the step",
        pipeline=True,
    ),
    Metric(
        "pp.stage_mem_peak_mib",
        "ferry_pipeline_stage_memory_peak_bytes",
        "stage",
        "peak memory of the process running each pipeline stage (bytes)",
        2**20,
        pipeline=True,
    ),
    Metric(
        "tracker_failures",
        "ferry_tracker_failures",
        "step",
        "records and files the run's trackers (metrics.trackers) failed to take so far, each dropped while training "
        "went on",
        opt_in=True,
    ),
    Metric(
        "mtp.loss",
        "ferry_mtp_loss",
        "depth",
        "multi-token prediction: each module's cross-entropy on the tokens it predicts, {depth: value}",
        objective="lm",
        opt_in=True,
    ),
    Metric(
        "cp.comm_s",
        "ferry_context_parallel_comm_seconds",
        "step",
        "time this rank spent in the context-parallel exchanges of the step (the keys' gathers and their gradients' "
        "reduce-scatters, the routers' sums)",
        opt_in=True,
    ),
    Metric(
        "cp.bytes",
        "ferry_context_parallel_bytes",
        "step",
        "bytes of the step's context-parallel exchanges on this rank (each gather counted at its output's size)",
        opt_in=True,
    ),
    Metric(
        "attn.max_logit",
        "ferry_attention_max_logit",
        "step",
        "largest attention logit of the step's training forwards, over every layer and head (metrics.attn_max_logit, "
        "or optim.muon.qk_clip)",
        opt_in=True,
    ),
    Metric(
        "attn.clipped_heads",
        "ferry_attention_clipped_heads",
        "step",
        "heads (over every layer) whose query and key weights QK-clip scaled after the step's update",
        opt_in=True,
    ),
    Metric("moe.tokens_per_expert", "ferry_moe_expert_tokens", "expert", "assignments per expert in the step"),
    *_moe("imbalance", "busiest expert's load / mean expert load", "mean"),
    *_moe("cv", "coefficient of variation of the expert loads", "mean"),
    *_moe("ep_imbalance", "busiest EP rank's load / mean EP rank load", "mean"),
    *_moe("dropped_tokens", "assignments over an expert's capacity (0 when dropless)", "sum"),
    *_moe("router_entropy", "mean over tokens of the routing distribution's entropy, in nats", "mean"),
    *_moe("aux_score", "switch balancing score of the step's loads and probabilities (1 = balanced)", "mean"),
    *_moe("balance_gap", "how much more concentrated the real load is than the aux score says", "max"),
    _dpo("rewards/chosen", "rewards_chosen", "beta x (policy - reference) log-prob of the chosen answers, mean"),
    _dpo("rewards/rejected", "rewards_rejected", "the same implicit reward of the rejected answers, mean"),
    _dpo("rewards/margin", "rewards_margin", "rewards/chosen - rewards/rejected, mean over pairs"),
    _dpo("rewards/accuracy", "rewards_accuracy", "share of pairs whose chosen answer earns the higher reward"),
    _dpo("logps/chosen", "logps_chosen", "the policy's summed log-prob of a chosen answer, mean"),
    _dpo("logps/rejected", "logps_rejected", "the policy's summed log-prob of a rejected answer, mean"),
    _grpo("reward", "reward", "mean verifier reward of the step's completions"),
    _grpo("reward_std", "reward_std", "standard deviation of the rewards within a group, mean over groups"),
    _grpo("solve_rate", "solve_rate", "share of the step's completions the verifier accepts"),
    _grpo("kl", "kl", "k3 estimate of KL(policy || reference), mean over trained tokens"),
    _grpo("clip_fraction", "clip_fraction", "share of trained tokens whose importance ratio was clipped"),
    _grpo("completion_length", "completion_length", "tokens per sampled completion, mean"),
    _grpo("filtered_groups", "filtered_groups", "share of groups left out because every reward was equal"),
    Metric(
        "eval/rewards/accuracy",
        "ferry_eval_dpo_rewards_accuracy",
        "source",
        "DPO: rewards/accuracy on held-out pairs",
        objective="dpo",
    ),
    Metric(
        "eval/rewards/margin",
        "ferry_eval_dpo_rewards_margin",
        "source",
        "DPO: rewards/margin on held-out pairs",
        objective="dpo",
    ),
    Metric(
        "eval/solve_rate",
        "ferry_eval_solve_rate",
        "source",
        "GRPO: share of held-out completions solved, 4 sampled a prompt at the rollout temperature (fixed seeds)",
        objective="grpo",
    ),
    Metric(
        "eval/greedy_solve_rate",
        "ferry_eval_greedy_solve_rate",
        "source",
        "GRPO: held-out solve rate, greedy",
        objective="grpo",
    ),
    Metric(
        "eval.loss", "ferry_eval_loss", "source", "held-out next-token cross-entropy per eval source", objective="lm"
    ),
    Metric("eval.perplexity", "ferry_eval_perplexity", "source", "exp(eval.loss) per eval source", objective="lm"),
)


def objective_keys(objective: str, pipelined: bool = False) -> set[str]:
    """The record keys a run of `objective` reports (its own and every objective's; with `pipelined`, the
    pipeline's too)."""
    return {
        metric.key
        for metric in METRICS
        if metric.objective in (None, objective) and (pipelined or not metric.pipeline) and not metric.opt_in
    }


def prometheus_names() -> set[str]:
    return {metric.prometheus for metric in METRICS}


def scalars(record: dict) -> dict[str, float]:
    """A step record's numbers as the trackers and TensorBoard name them: a step metric by its key, a per-layer
    or per-stage one `<key>/<shape><i>`, a held-out one `<key>/<source>`; per-expert loads stay in metrics.jsonl
    and Prometheus, where a heatmap can show them, instead of thousands of scalar charts."""
    named = {}
    for metric in METRICS:
        value = record.get(metric.key)
        if value is None or metric.shape == "expert":
            continue
        if metric.shape == "step":
            named[metric.key] = float(value)
        elif metric.shape == "source":
            named.update({f"{metric.key}/{source}": float(number) for source, number in value.items()})
        elif metric.shape == "depth":
            named.update({f"{metric.key}/depth{depth}": float(number) for depth, number in value.items()})
        else:  # per layer or per stage
            named.update({f"{metric.key}/{metric.shape}{index}": float(number) for index, number in enumerate(value)})
    return named

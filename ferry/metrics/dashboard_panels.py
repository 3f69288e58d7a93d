"""What the Grafana dashboard shows: its rows, each row's panels, each panel's queries.

Every Prometheus name of `ferry/metrics/names.py` is on some panel (`tests/test_dashboard.py` holds it), so a
metric added there comes with its panel here. A query names its metric and the labels its shape adds; the builder
(`dashboard.py`) adds the job, instance and run matchers every query carries. Rows whose series only some runs
export (an objective's, a pipeline's, context parallelism's, opt-in figures) start collapsed, so a run without them
shows no empty panels.
"""

from __future__ import annotations

from ferry.metrics.dashboard_model import Panel, Query, Row, per_layer, series

EXPERT_LOAD = (  # each expert's load over its layer's mean
    "ferry_moe_expert_tokens{SELECT} / ignoring(expert) group_left "
    "avg without(expert) (ferry_moe_expert_tokens{SELECT})"
)

ROWS: tuple[Row, ...] = (
    Row(
        "Training",
        (
            Panel(
                "Loss",
                "objective and its cross-entropy part, and the held-out loss per eval source (nats)",
                "none",
                (
                    series("loss", "loss"),
                    series("lm_loss", "lm_loss"),
                    Query("ferry_eval_loss", "held-out {{source}} {{run}}"),
                ),
            ),
            Panel(
                "Router losses",
                "load-balancing loss (1.0 at perfect balance) and router z-loss",
                "none",
                (series("aux_loss", "aux_loss"), series("z_loss", "z_loss")),
            ),
            Panel(
                "Learning rate and gradient norm",
                "the step's learning rate and the global gradient norm before clipping",
                "none",
                (series("learning_rate", "lr"), series("grad_norm", "grad norm")),
            ),
            Panel(
                "Token accuracy and trained share",
                "share of trained tokens ranked first; trained tokens over the step's tokens (below 1 under a loss "
                "mask)",
                "percentunit",
                (series("token_accuracy", "accuracy"), series("trained_share", "trained share")),
            ),
            Panel(
                "Held-out perplexity",
                "exp(held-out loss) per eval source, on the steps that evaluate",
                "none",
                (Query("ferry_eval_perplexity", "{{source}} {{run}}"),),
            ),
            Panel(
                "Loss scaling",
                "the loss scale (1 without loss scaling) and the steps skipped for overflowed gradients",
                "short",
                (series("loss_scale", "scale"), series("skipped_steps", "skipped steps")),
            ),
        ),
    ),
    Row(
        "Throughput",
        (
            Panel(
                "Tokens per second",
                "tokens of the step over all devices, and per device",
                "short",
                (
                    series("tokens_per_second", "tok/s"),
                    series("tokens_per_second_per_device", "tok/s/device"),
                ),
            ),
            Panel(
                "MFU",
                "model FLOPs utilisation against the hardware profile's peak for the dtype in use",
                "percentunit",
                (series("mfu", "mfu"),),
            ),
            Panel(
                "Progress",
                "optimizer steps completed and tokens trained on",
                "short",
                (series("step", "step"), series("tokens_seen", "tokens seen")),
                kind="stat",
                width=4,
            ),
            Panel(
                "Memory",
                "peak memory of rank 0's process, and the optimizer state it holds (ZeRO-1 shrinks it)",
                "bytes",
                (series("memory_peak_bytes", "peak"), series("optimizer_state_bytes", "optimizer state")),
                width=4,
            ),
        ),
    ),
    Row(
        "Step time",
        (
            Panel(
                "Step time by phase",
                "forward, backward, optimizer and generation (GRPO rollouts) time of the step",
                "s",
                (
                    series("forward_seconds", "forward"),
                    series("backward_seconds", "backward"),
                    series("optimizer_seconds", "optimizer"),
                    series("generate_seconds", "generate"),
                ),
            ),
            Panel(
                "Compute vs communication",
                "time computing, blocked in collectives, and blocked in the MoE exchanges, against the step",
                "s",
                (
                    series("compute_seconds", "compute"),
                    series("comm_seconds", "comm"),
                    series("ep_wait_seconds", "ep wait"),
                    series("step_seconds", "step"),
                ),
            ),
            Panel(
                "Communication / compute",
                "time blocked in collectives over compute time",
                "none",
                (series("comm_compute_ratio", "comm/compute"),),
            ),
        ),
    ),
    Row(
        "Communication",
        (
            Panel(
                "Bytes by link tier",
                "bytes rank 0 handed to collectives in the step, and of them those sent to its node's ranks and to "
                "other nodes'",
                "bytes",
                (
                    series("comm_bytes", "all"),
                    series("intra_node_bytes", "inside the node"),
                    series("inter_node_bytes", "between nodes"),
                ),
            ),
            Panel(
                "Collective time by link tier",
                "time of rank 0's collectives whose groups lie inside one node, and of those spanning nodes",
                "s",
                (
                    series("intra_node_comm_seconds", "inside the node"),
                    series("inter_node_comm_seconds", "between nodes"),
                ),
            ),
            Panel(
                "Expert exchanges",
                "time the MoE exchanges were in flight, and the part of it the rank waited for",
                "s",
                (series("ep_comm_seconds", "in flight"), series("ep_wait_seconds", "waited")),
            ),
            Panel(
                "Expert exchange overlap",
                "share of the exchanges' time in flight the rank computed through (0 with ep_overlap none)",
                "percentunit",
                (series("ep_overlap_share", "overlapped"),),
            ),
            Panel(
                "Expert exchanges issued",
                "MoE exchanges the step's forwards issued: more when chunked, rowwise or hierarchical",
                "short",
                (series("ep_exchanges", "exchanges"),),
            ),
        ),
    ),
    Row(
        "Mixture of experts",
        (
            Panel(
                "Load imbalance",
                "busiest expert's and busiest EP rank's load over the mean, and the loads' coefficient of variation",
                "none",
                (
                    series("moe_imbalance", "imbalance"),
                    series("moe_ep_imbalance", "EP imbalance"),
                    series("moe_cv", "cv"),
                ),
            ),
            Panel(
                "Aux score vs real load",
                "the switch balancing score (1 = balanced) and how much more concentrated the real load is",
                "none",
                (series("moe_aux_score", "aux score"), series("moe_balance_gap", "balance gap")),
            ),
            Panel(
                "Router entropy and dropped tokens",
                "mean routing entropy (nats) and assignments over an expert's capacity (0 when dropless)",
                "none",
                (series("moe_router_entropy", "entropy"), series("moe_dropped_tokens", "dropped")),
            ),
            Panel(
                "Imbalance per layer",
                "busiest expert's and busiest EP rank's load over the mean, per MoE layer",
                "none",
                (per_layer("moe_layer_imbalance", "imbalance"), per_layer("moe_layer_ep_imbalance", "EP")),
            ),
            Panel(
                "Balance gap per layer",
                "balance gap and aux score per MoE layer",
                "none",
                (per_layer("moe_layer_balance_gap", "gap"), per_layer("moe_layer_aux_score", "aux score")),
            ),
            Panel(
                "Per layer: CV, entropy, dropped",
                "coefficient of variation, routing entropy and dropped assignments per MoE layer",
                "none",
                (
                    per_layer("moe_layer_cv", "cv"),
                    per_layer("moe_layer_router_entropy", "entropy"),
                    per_layer("moe_layer_dropped_tokens", "dropped"),
                ),
            ),
            Panel(
                "Expert load over time (load / mean, layer $layer)",
                "one row per expert of the chosen layer; 1 is an even share",
                "none",
                (Query("ferry_moe_expert_tokens", "{{expert}}", expr=EXPERT_LOAD, where='layer="$layer"'),),
                kind="heatmap",
                width=24,
                height=10,
            ),
        ),
    ),
    Row(
        "Reliability",
        (
            Panel(
                "Goodput",
                "productive step time over the job's wall time so far, restarts included",
                "percentunit",
                (series("goodput", "goodput"),),
            ),
            Panel(
                "Checkpoint time",
                "time training waited for saves in the step, and the time the saves that ended in it took to write",
                "s",
                (
                    series("checkpoint_blocked_seconds", "blocked"),
                    series("checkpoint_write_seconds", "write"),
                ),
            ),
            Panel(
                "Failures",
                "saves the storage refused in this attempt, steps trained again after failures, and records the "
                "trackers dropped",
                "short",
                (
                    series("checkpoint_failed_saves", "failed saves"),
                    series("lost_steps", "lost steps"),
                    series("tracker_failures", "tracker failures"),
                ),
            ),
            Panel(
                "Restarts",
                "time verifying and restoring checkpoints, and from failures to restored restarts, since the job began",
                "s",
                (series("loading_seconds", "loading"), series("restarting_seconds", "restarting")),
            ),
            Panel(
                "Checkpoint interval",
                "steps between checkpoints (Young/Daly when checkpoint.interval is auto)",
                "short",
                (series("checkpoint_interval_steps", "interval"),),
            ),
        ),
    ),
    Row(
        "Pipeline",
        (
            Panel(
                "Pipeline bubble",
                "share of the schedule's time a rank was not computing, mean over the pipeline's ranks",
                "percentunit",
                (series("pipeline_bubble", "bubble"),),
            ),
            Panel(
                "Pipeline schedule and stages",
                "time rank 0 spent in the schedule, and each stage's forward and backward compute",
                "s",
                (
                    series("pipeline_schedule_seconds", "schedule"),
                    Query("ferry_pipeline_stage_busy_seconds", "stage {{stage}} busy {{run}}"),
                ),
            ),
            Panel(
                "Memory per stage",
                "peak memory of the process running each stage",
                "bytes",
                (Query("ferry_pipeline_stage_memory_peak_bytes", "stage {{stage}} {{run}}"),),
            ),
        ),
        collapsed=True,
        family="pipeline",
    ),
    Row(
        "Context parallelism",
        (
            Panel(
                "Context-parallel exchanges",
                "time this rank spent in the keys' gathers, their gradients' reduce-scatters and the routers' sums",
                "s",
                (series("context_parallel_comm_seconds", "cp comm"),),
            ),
            Panel(
                "Context-parallel bytes",
                "bytes of the step's context-parallel exchanges on this rank",
                "bytes",
                (series("context_parallel_bytes", "cp bytes"),),
            ),
        ),
        collapsed=True,
        family="context",
    ),
    Row(
        "Attention and multi-token prediction",
        (
            Panel(
                "Attention logits",
                "largest attention logit of the step over every layer and head (metrics.attn_max_logit or QK-clip)",
                "none",
                (series("attention_max_logit", "max logit"),),
            ),
            Panel(
                "QK-clip",
                "heads whose query and key weights QK-clip scaled after the step's update",
                "short",
                (series("attention_clipped_heads", "clipped heads"),),
            ),
            Panel(
                "Multi-token prediction",
                "each MTP module's cross-entropy on the tokens it predicts (nats)",
                "none",
                (Query("ferry_mtp_loss", "depth {{depth}} {{run}}"),),
            ),
        ),
        collapsed=True,
        family="lm",
    ),
    Row(
        "DPO",
        (
            Panel(
                "Implicit rewards",
                "beta x (policy - reference) log-prob of the chosen and rejected answers, and their margin",
                "none",
                (
                    series("dpo_rewards_chosen", "chosen"),
                    series("dpo_rewards_rejected", "rejected"),
                    series("dpo_rewards_margin", "margin"),
                    Query("ferry_eval_dpo_rewards_margin", "held-out {{source}} margin {{run}}"),
                ),
            ),
            Panel(
                "Reward accuracy",
                "share of pairs whose chosen answer earns the higher reward, in training and held out",
                "percentunit",
                (
                    series("dpo_rewards_accuracy", "train"),
                    Query("ferry_eval_dpo_rewards_accuracy", "held-out {{source}} {{run}}"),
                ),
            ),
            Panel(
                "Log-probabilities",
                "the policy's summed log-prob of a chosen and of a rejected answer, mean",
                "none",
                (series("dpo_logps_chosen", "chosen"), series("dpo_logps_rejected", "rejected")),
            ),
        ),
        collapsed=True,
        family="dpo",
    ),
    Row(
        "GRPO",
        (
            Panel(
                "Rewards",
                "mean verifier reward of the step's completions, and its spread within a group",
                "none",
                (series("grpo_reward", "reward"), series("grpo_reward_std", "std in group")),
            ),
            Panel(
                "Solve rate",
                "share of completions the verifier accepts: the step's, and held out (sampled and greedy)",
                "percentunit",
                (
                    series("grpo_solve_rate", "train"),
                    Query("ferry_eval_solve_rate", "held-out {{source}} {{run}}"),
                    Query("ferry_eval_greedy_solve_rate", "held-out greedy {{source}} {{run}}"),
                ),
            ),
            Panel(
                "Policy drift",
                "KL to the reference (k3 estimate) and the share of tokens whose importance ratio was clipped",
                "none",
                (series("grpo_kl", "kl"), series("grpo_clip_fraction", "clip fraction")),
            ),
            Panel(
                "Completions",
                "tokens per sampled completion, and the share of groups left out for equal rewards",
                "short",
                (series("grpo_completion_length", "length"), series("grpo_filtered_groups", "filtered groups")),
            ),
        ),
        collapsed=True,
        family="grpo",
    ),
)

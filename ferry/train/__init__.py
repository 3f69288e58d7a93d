"""Training: the run config, the trainer loop, losses, optimizer and schedule, run records, checkpoint state."""

from ferry.train.config import OptimConfig, RunConfig, RunSection, TrainConfig, load_run_config
from ferry.train.hook_points import Hook, RunEnd
from ferry.train.trainer import Trainer, TrainResult, train

__all__ = [
    "Hook",
    "RunEnd",
    "OptimConfig",
    "RunConfig",
    "RunSection",
    "TrainConfig",
    "load_run_config",
    "Trainer",
    "TrainResult",
    "train",
]

"""Loss scaling: keep small fp16 gradients representable, and skip steps whose gradients overflow.

The scaler multiplies the loss before backward and divides the gradients after.
`dynamic` checks the unscaled gradients for inf/NaN: a bad step is skipped (the
optimizer never sees it, so no parameter or moment moves), the scale backs off,
and after `growth_interval` clean steps it grows again. Its state is three numbers,
saved in checkpoints as JSON.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ferry.precision.config import LossScalingConfig


class LossScaler:
    def __init__(self, kind: str, config: LossScalingConfig):
        self.kind = kind
        self.config = config
        self.scale = config.init_scale if kind != "none" else 1.0
        self.clean_steps = 0
        self.skipped_steps = 0

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_and_check(self, parameters: Iterable[torch.Tensor]) -> bool:
        """Divide every gradient by the scale; return True when all of them are finite."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if self.enabled and grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        if not grads:
            return True
        norms = torch.stack(torch._foreach_norm(grads))
        return bool(torch.isfinite(norms).all())

    def update(self, grads_finite: bool) -> None:
        """Back off after an overflow (dynamic only), grow after `growth_interval` clean steps."""
        if not grads_finite:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.kind == "dynamic":
                self.scale *= self.config.backoff_factor
            return
        self.clean_steps += 1
        if self.kind == "dynamic" and self.clean_steps >= self.config.growth_interval:
            self.scale *= self.config.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])

"""Joining the job's process group."""

import torch
import torch.distributed as dist

from ferry.comm import CommConfig, init_distributed


def test_a_rank_on_an_accelerator_makes_its_own_device_current_before_joining(monkeypatch):
    """Object collectives stage on the current device, so rank 1 of a node must not leave device 0 current."""
    calls = []

    class Accelerator:
        @staticmethod
        def set_device(device):
            calls.append(("set_device", device))

    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch, "get_device_module", lambda kind: Accelerator)
    monkeypatch.setattr(dist, "is_backend_available", lambda name: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **options: calls.append(("join", options["device_id"])))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    device = torch.device("cuda", 1)
    context = init_distributed(CommConfig(backend="nccl"), device)
    assert calls == [("set_device", device), ("join", device)]
    assert (context.rank, context.world_size, context.local_rank, context.backend) == (1, 2, 1, "nccl")

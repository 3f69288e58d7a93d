"""The chunked head loss (`train.loss_chunk`) is the logits-then-loss computation without the logits."""

import pytest
import torch
import torch.nn.functional as F

from ferry.data.targets import IGNORE_INDEX
from ferry.model.head_loss import HeadTargets, chunked_head_loss


def _inputs():
    generator = torch.Generator().manual_seed(0)
    h_BSD = torch.randn(3, 50, 32, generator=generator).requires_grad_()
    weight_VD = (0.3 * torch.randn(97, 32, generator=generator)).requires_grad_()
    targets_BS = torch.randint(0, 97, (3, 50), generator=generator)
    targets_BS[:, :5] = IGNORE_INDEX  # a prompt
    targets_BS[2, 40:] = IGNORE_INDEX  # padding
    return h_BSD, weight_VD, targets_BS


@pytest.mark.parametrize("chunk", [1, 16, 150, 4096])
def test_loss_accuracy_and_gradients_equal_logits_then_cross_entropy(chunk):
    h_BSD, weight_VD, targets_BS = _inputs()
    logits_TV = F.linear(h_BSD, weight_VD).reshape(-1, 97)
    expected = F.cross_entropy(logits_TV, targets_BS.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    expected_correct = (logits_TV.argmax(-1) == targets_BS.reshape(-1)).sum()
    (0.37 * expected).backward()
    expected_grads = [h_BSD.grad.clone(), weight_VD.grad.clone()]
    h_BSD.grad = weight_VD.grad = None

    loss = chunked_head_loss(h_BSD, weight_VD, HeadTargets(targets_BS, chunk))
    (0.37 * loss.lm_loss_sum).backward()
    assert loss.lm_loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)
    assert loss.correct.item() == expected_correct.item() > 0
    assert torch.allclose(h_BSD.grad, expected_grads[0], rtol=1e-5, atol=1e-7)
    assert torch.allclose(weight_VD.grad, expected_grads[1], rtol=1e-5, atol=1e-6)
    assert h_BSD.grad[2, 40:].abs().max() == 0, "untrained targets send no gradient"


def _matmuls(run) -> int:
    """How many matrix products `run()` performs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    return Count.calls


def test_without_gradients_it_computes_the_loss_alone():
    """An evaluation (no_grad) makes each chunk's logits and nothing else: one product a chunk, not three."""
    h_BSD, weight_VD, targets_BS = _inputs()
    chunks = -(-150 // 16)
    assert _matmuls(lambda: chunked_head_loss(h_BSD, weight_VD, HeadTargets(targets_BS, 16))) == 3 * chunks
    with torch.no_grad():
        assert _matmuls(lambda: chunked_head_loss(h_BSD, weight_VD, HeadTargets(targets_BS, 16))) == chunks
        loss = chunked_head_loss(h_BSD, weight_VD, HeadTargets(targets_BS, 16))
    expected = F.cross_entropy(
        F.linear(h_BSD, weight_VD).reshape(-1, 97), targets_BS.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    assert not loss.lm_loss_sum.requires_grad
    assert loss.lm_loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)


def test_under_autocast_the_gemms_run_in_its_dtype():
    h_BSD, weight_VD, targets_BS = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_head_loss(h_BSD, weight_VD, HeadTargets(targets_BS, 16))
        logits_TV = F.linear(h_BSD, weight_VD).float().reshape(-1, 97)
    expected = F.cross_entropy(logits_TV, targets_BS.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    assert loss.lm_loss_sum.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.lm_loss_sum.backward()
    assert h_BSD.grad.dtype == weight_VD.grad.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_in_bfloat16_it_agrees_and_holds_less_memory():
    """bf16 GEMMs under autocast, as a GPU run computes: the same loss and gradients as logits-then-loss within
    bf16's rounding, and a lower allocator peak (the logits of 4,096 tokens over 32,768 are 512 MiB in fp32)."""
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    h_BSD = torch.randn(1, 4096, 256, device=device, generator=generator).requires_grad_()
    weight_VD = (0.02 * torch.randn(32768, 256, device=device, generator=generator)).requires_grad_()
    targets_BS = torch.randint(0, 32768, (1, 4096), device=device, generator=generator)

    def run(chunk: int) -> tuple[float, list[torch.Tensor], int]:
        h_BSD.grad = weight_VD.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if chunk:
                loss = chunked_head_loss(h_BSD, weight_VD, HeadTargets(targets_BS, chunk)).lm_loss_sum
            else:
                logits_TV = F.linear(h_BSD, weight_VD).float().reshape(-1, 32768)
                loss = F.cross_entropy(logits_TV, targets_BS.reshape(-1), reduction="sum")
        (loss / 4096).backward()
        torch.cuda.synchronize()
        return loss.item(), [h_BSD.grad.clone(), weight_VD.grad.clone()], torch.cuda.max_memory_allocated() - before

    expected, expected_grads, logits_peak = run(0)
    loss, grads, chunked_peak = run(1024)
    assert loss == pytest.approx(expected, rel=1e-3)
    for grad, expected_grad in zip(grads, expected_grads):
        assert (grad - expected_grad).norm() <= 2e-2 * expected_grad.norm()
    assert chunked_peak < 0.5 * logits_peak, (chunked_peak, logits_peak)

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


def test_without_gradients_it_computes_the_loss_alone():
    h_BSD, weight_VD, targets_BS = _inputs()
    with torch.no_grad():
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

"""The cross-entropy with an in-place backward against torch's `F.cross_entropy`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferry.train.objectives.cross_entropy import cross_entropy

IGNORE = -100


def logits_and_targets(tokens: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits_TV = (torch.randn(tokens, vocab, generator=generator) * 3).to(dtype=dtype, device=device)
    targets_T = torch.randint(0, vocab, (tokens,), generator=generator)
    targets_T[::5] = IGNORE  # prompts and padding
    return logits_TV, targets_T.to(device)


def loss_and_gradient(loss_fn, logits_TV, targets_T, reduction, grad_loss):
    leaf_TV = logits_TV.detach().clone().requires_grad_()
    loss = loss_fn(leaf_TV, targets_T, reduction)
    loss.backward(grad_loss)
    return loss.detach(), leaf_TV.grad


def torchs(logits_TV, targets_T, reduction):
    return F.cross_entropy(logits_TV, targets_T, ignore_index=IGNORE, reduction=reduction)


def ferrys(logits_TV, targets_T, reduction):
    return cross_entropy(logits_TV, targets_T, IGNORE, reduction)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize(
    "tokens, vocab, dtype, tolerance",
    [
        (37, 11, torch.float32, 1e-6),
        (512, 4096, torch.float32, 1e-6),
        (64, 50304, torch.float32, 1e-6),  # an OLMoE-sized vocabulary
        (256, 1000, torch.bfloat16, 8e-3),  # logits left in bf16: both sides round the gradient to bf16
    ],
)
def test_loss_is_torchs_and_gradient_equals_torchs(device, reduction, tokens, vocab, dtype, tolerance):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    logits_TV, targets_T = logits_and_targets(tokens, vocab, dtype, device)
    generator = torch.Generator().manual_seed(1)
    grad_loss = torch.tensor(0.37) if reduction == "sum" else torch.randn(tokens, generator=generator)
    grad_loss = grad_loss.to(device)
    expected_loss, expected_grad = loss_and_gradient(torchs, logits_TV, targets_T, reduction, grad_loss)
    loss, grad = loss_and_gradient(ferrys, logits_TV, targets_T, reduction, grad_loss)
    assert torch.equal(loss, expected_loss)  # the forward is torch's log-softmax and negative log-likelihood
    assert grad.dtype == expected_grad.dtype and grad.shape == expected_grad.shape
    error = ((grad.double() - expected_grad.double()).norm() / expected_grad.double().norm()).item()
    assert error < tolerance
    ignored_T = targets_T == IGNORE
    assert torch.count_nonzero(grad[ignored_T]) == 0  # untrained targets send no gradient
    assert torch.count_nonzero(grad[~ignored_T]) == grad[~ignored_T].numel()


def test_backward_allocates_no_tensor_of_the_logits_size():
    logits_TV, targets_T = logits_and_targets(256, 2048, torch.float32, "cpu")
    leaf_TV = logits_TV.clone().requires_grad_()
    saved = []  # (shape, address) only: holding the tensor would make autograd copy the leaf's gradient

    def note(tensor):
        saved.append((tensor.shape, tensor.data_ptr()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(note, lambda tensor: tensor):
        loss = ferrys(leaf_TV, targets_T, "sum")
    logits_sized = [address for shape, address in saved if shape == logits_TV.shape]
    assert len(logits_sized) == 1  # the log-softmax, and nothing else of that size
    loss.backward()
    assert leaf_TV.grad.data_ptr() == logits_sized[0]  # the gradient is written where the log-softmax lay


def test_a_second_backward_through_a_retained_graph_is_refused():
    logits_TV, targets_T = logits_and_targets(16, 32, torch.float32, "cpu")
    leaf_TV = logits_TV.clone().requires_grad_()
    loss = ferrys(leaf_TV, targets_T, "sum")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_no_grad_keeps_nothing_and_gives_torchs_loss():
    logits_TV, targets_T = logits_and_targets(64, 128, torch.float32, "cpu")
    with torch.no_grad():
        loss_T = ferrys(logits_TV.requires_grad_(), targets_T, "none")
    assert loss_T.grad_fn is None
    assert torch.equal(loss_T, torchs(logits_TV.detach(), targets_T, "none"))

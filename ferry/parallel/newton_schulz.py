"""Newton-Schulz orthogonalisation, the heart of Muon: U V^T of a matrix U S V^T without an SVD.

A few quintic iterations push every singular value of a matrix scaled to norm 1 towards 1 (not exactly: Keller
Jordan's coefficients trade exactness for speed, leaving them in about [0.7, 1.2]), using matrix products only,
which every accelerator runs at full speed in bf16.
"""

from __future__ import annotations

import torch

# Keller Jordan's quintic coefficients (torch.optim.Muon's defaults)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def orthogonalise(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz approximation of U V^T for `update` = U S V^T, of each matrix of a batch
    [..., A, B] on its own, in `dtype` (returned in it). Each matrix is scaled to Frobenius norm 1 first, so its
    spectral norm is at most 1; the wide orientation keeps the Gram matrix the smaller one."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = update.shape[-2] > update.shape[-1]
    if tall:
        x = x.mT
    if x.ndim == 2:  # torch.optim.Muon's operations, one by one
        x = x.div(x.norm().clamp(min=NS_EPS))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x

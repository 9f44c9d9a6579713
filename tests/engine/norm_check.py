"""The RMSNorm kernels' yardstick, shared by their CPU (interpreter) and GPU tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.spec import rms_normalize_reference


def norm_errors(x, w, grad, fused):
    """Distances of `fused(x, w)` (y, dx, dw) to a float32 autograd of weight * the reference normalisation,
    and the same distances for torch's path (`F.rms_norm`, then the weight) on the same low-precision inputs."""
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = w32 * rms_normalize_reference(x32, 1e-6)
    refs = (ref, *torch.autograd.grad(ref, (x32, w32), grad.float()))
    out = []
    for path in (fused, lambda a, b: b * F.rms_norm(a, (a.shape[-1],), eps=1e-6)):
        xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = path(xx, ww)
        got = (y, *torch.autograd.grad(y, (xx, ww), grad))
        assert all(a.dtype == x.dtype and a.shape == b.shape for a, b in zip(got, refs))
        out.append([(a.float() - b).abs() for a, b in zip(got, refs)])
    return out

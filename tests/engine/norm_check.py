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


def assert_no_further_than_torch(x, w, grad, fused, slack_max: float, slack_mean: float) -> None:
    """`fused`'s y, dx and dw within 1.5x (plus the slack) of torch's path's largest and mean distance to the
    float32 autograd (`norm_errors`)."""
    ours, torch_path = norm_errors(x, w, grad, fused)
    for name, e, e_ref in zip(("y", "dx", "dw"), ours, torch_path):
        assert e.max() <= 1.5 * e_ref.max() + slack_max, (name, float(e.max()), float(e_ref.max()))
        assert e.mean() <= 1.5 * e_ref.mean() + slack_mean, (name, float(e.mean()), float(e_ref.mean()))

"""RMSNorm, computed in float32 as Hugging Face does, result in the input dtype."""

import torch
import torch.nn.functional as F

_HAS_RMS_NORM = hasattr(F, "rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, statistics in float32."""
    dtype = x.dtype
    if _HAS_RMS_NORM and weight.dtype == dtype:
        # One fused kernel (float32 accumulation inside) instead of four; the product with the
        # weight is rounded once, where Hugging Face rounds before and after it: at most one unit in
        # the last place of the dtype apart, and the same arithmetic in float32.
        return F.rms_norm(x, x.shape[-1:], weight=weight, eps=eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)

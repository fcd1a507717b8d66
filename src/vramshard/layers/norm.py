"""RMSNorm, computed in float32 as Hugging Face does, result in the input dtype."""

import torch
import torch.nn.functional as F

_HAS_RMS_NORM = hasattr(F, "rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    if _HAS_RMS_NORM:
        # One fused kernel on the GPU; the same float32 arithmetic as below.
        return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(dtype)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)

"""Host rows to the device with one copy each: what recall sends to the cache's device (``to_device``)."""

from __future__ import annotations

import torch
from torch import Tensor

#: byte alignment of each tensor packed for one copy (so each can be viewed in its dtype on arrival)
ALIGN = 16


def to_device(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """Host tensors on ``device`` with one copy: packed back to back into one host buffer (pinned on CUDA, the
    copy non-blocking), sent, and viewed in their dtypes and shapes there. Tensors already on ``device`` (a CPU
    cache) are returned as they are: packing them would only copy every scored row once more. The pinned
    buffer comes from torch's caching host allocator, which reuses a block only once the copies recorded on it
    have finished."""
    if all(t.device == device for t in tensors):
        return list(tensors)
    sizes = [t.numel() * t.element_size() for t in tensors]
    at, offsets = 0, []
    for n in sizes:
        offsets.append(at)
        at += -(-n // ALIGN) * ALIGN
    host = torch.empty(max(at, 1), dtype=torch.uint8, pin_memory=device.type == "cuda")
    for t, start, n in zip(tensors, offsets, sizes, strict=True):
        host[start : start + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    buf = host.to(device, non_blocking=True)
    return [buf[start : start + n].view(t.dtype).view(t.shape)
            for t, start, n in zip(tensors, offsets, sizes, strict=True)]

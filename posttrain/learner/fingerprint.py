"""A fingerprint of a model's weights: which frozen model (a distillation teacher) a run was trained against.

A run records it in each checkpoint and a resume compares it with the model it loads now, so a directory
whose weights were replaced between the two (same path, another model) is refused instead of silently
changing the training signal mid-run (issue 38: reverse KL 2.08 -> 3.58 after a swapped teacher).
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["weights_fingerprint"]


def weights_fingerprint(model: torch.nn.Module) -> str:
    """``blake2b`` (16 bytes, hex) of ``model``'s state dict: every tensor's name, dtype, shape and bytes, in
    name order. Equal for the same weights loaded twice (any device: bytes are read on the CPU); any changed
    element, shape, dtype or name changes it."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()

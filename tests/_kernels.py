"""What this CPU's float32 kernels compute, as a short fingerprint, to key golden runs by numerics.

The instruction-set name is not the numerics: on an AMD EPYC that reports AVX-512 (``torch.backends.cpu.
get_cpu_capability() == "AVX512"``) PyTorch's BLAS (MKL) takes its AVX2 path while ATen's own kernels use
AVX-512, a mix no instruction-set name describes, and an AVX-512 Xeon's BLAS uses other blockings again. A
golden that can only be reproduced by the same kernels (many optimiser steps of rounding decide sampled
tokens) is therefore keyed by :func:`gemm_fingerprint`: the bytes of a few fixed float32 GEMMs at the tiny
model's shapes (hidden 128, MLP 384, K up to 384, the projections ``F.linear`` runs in the model) and of
ATen's own vectorised kernels on their results (which differ between ATen's AVX2 and AVX-512 builds), hashed.
The inputs are 24-bit integers over 2**24, exact in float32 and independent of any random generator, with full
mantissas so that every product and partial sum rounds (small integers would sum exactly in any order and hide
the kernel); two machines agree on the fingerprint exactly when their kernels round these reductions the same
way.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

__all__ = ["gemm_fingerprint"]

# (rows, in_features, out_features): attention q/o (128 -> 128), k/v (128 -> 64), MLP up (128 -> 384) and
# down (384 -> 128), the LM head (128 -> vocab ~ 40), at a sampling batch (rows = 64) and a learner batch.
_SHAPES = ((64, 128, 128), (64, 128, 64), (64, 128, 384), (64, 384, 128), (64, 128, 40),
           (1024, 128, 384), (1024, 384, 128), (7, 128, 128))


def _exact(n: int, salt: int) -> torch.Tensor:
    """``n`` float32 values in [-0.5, 0.5), each ``k / 2**24 - 0.5`` for an integer ``k < 2**24`` (exact in
    float32), from integer arithmetic only."""
    i = torch.arange(n, dtype=torch.int64)
    k = (i * 2654435761 + salt * 40503 + 12345) % (1 << 24)
    return k.to(torch.float32) / float(1 << 24) - 0.5


def gemm_fingerprint() -> str:
    """sha256 (first 16 hex digits) of ``F.linear(x, w, b)`` over :data:`_SHAPES` and of ATen's vectorised
    ``log_softmax``, ``silu`` and ``rsqrt`` (the model's output, MLP and RMSNorm) of the results, at one thread.

    Both kinds of kernel decide demo5's tokens: on one AMD EPYC (MKL's AVX2 path either way) the run
    reproduces its golden under ATen's AVX-512 kernels and misses it in 602 of 2560 statuses under
    ``ATEN_CPU_CAPABILITY=avx2`` (issue 38). One thread: MKL splits some small products (7 rows) differently
    at two threads; the probe measures the kernels, not the caller's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    h = hashlib.sha256()
    try:
        with torch.no_grad():
            for s, (m, k, n) in enumerate(_SHAPES):
                x = _exact(m * k, 3 * s).view(m, k)
                w = _exact(n * k, 3 * s + 1).view(n, k) * 0.125
                y = F.linear(x, w, _exact(n, 3 * s + 2))
                for t in (y, x @ w.T, torch.log_softmax(3.0 * y, dim=-1), F.silu(y), torch.rsqrt(y.abs() + 0.5)):
                    h.update(t.numpy().tobytes())
    finally:
        torch.set_num_threads(before)
    return h.hexdigest()[:16]

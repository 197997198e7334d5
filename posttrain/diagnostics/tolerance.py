"""How far apart two computations of the same quantity may be when their batch shapes or thread counts differ.

Why not bit-exact: a CPU GEMM / reduction kernel is not batch-invariant — another ``M`` (rows per
micro-batch), another padded length or another thread count can pick another blocking and so
another summation order (MKL on AVX2-only AMD EPYC picks other kernels than on AVX-512 Intel). Two
such results agree only to the rounding error of the reductions involved.

Where the error comes from: Hugging Face's eager attention computes its softmax in **float32**
(``softmax(..., dtype=torch.float32)``) whatever the model's dtype, over at most ``T`` keys (the
padded sequence length). The textbook bound on a length-``n`` float sum is ``n * eps`` relative
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed. 2002, section 4.2), so

    tol = SAFETY * n * eps(dtype)

relative to the reference's largest magnitude. ``SAFETY = 4`` covers the few layers the error
travels through; measured differences are ~1 eps (float32) relative, while the bugs the comparisons
are about (a micro-batch's own denominator, a dropped micro-batch, a missing all-reduce, a ratio
taken against the wrong log-probs) move the result by >= 1e-3 relative.

The test suite (``tests/_tolerance.py``) and ``posttrain check`` use this one rule.
"""

from __future__ import annotations

import torch

SAFETY = 4.0
"""Headroom over the ``n * eps`` bound for the few layers the rounding error travels through."""


def shape_rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative tolerance ``SAFETY * n * eps(dtype)`` for a result whose reductions span <= n terms
    (``n < 1`` counts as 1)."""
    return SAFETY * max(int(n), 1) * torch.finfo(dtype).eps


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose rounding bounds a model of parameter dtype ``dtype``: ``dtype`` itself, but never
    finer than float32, since the attention softmax runs in float32 for a float64 model too."""
    return dtype if torch.finfo(dtype).eps > torch.finfo(torch.float32).eps else torch.float32

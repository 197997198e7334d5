"""Tolerances for comparing results computed with different batch shapes or thread counts.

Why not bit-exact: a CPU GEMM / reduction kernel is not batch-invariant — another ``M`` (rows per
micro-batch), another padded length or another thread count can pick another blocking and so
another summation order (MKL on AVX2-only AMD EPYC picks other kernels than on AVX-512 Intel). Two
such results agree only to the rounding error of the reductions involved.

Where the error comes from in our tiny float64 test models: Hugging Face's eager attention computes
its softmax in **float32** (``softmax(..., dtype=torch.float32)``) whatever the model's dtype, over
at most ``T`` keys (the padded sequence length). The textbook bound on a length-``n`` float sum is
``n * eps`` relative, so every comparison here uses

    tol = SAFETY * n * eps(dtype)          (dtype = float32 for the attention softmax)

relative to the reference's largest magnitude. ``SAFETY = 4`` covers the few layers the error
travels through; measured differences are ~1 eps (float32) relative, while the bugs these tests are
about (a micro-batch's own denominator, a dropped micro-batch, a missing all-reduce) move the
result by >= 1e-3 relative — ``tests/learner/test_actor.py::test_split_tolerance_catches_local_normaliser``
breaks the normaliser on purpose to show the tolerance still catches it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

SAFETY = 4.0


def shape_rtol(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative tolerance ``SAFETY * n * eps(dtype)`` for a result whose reductions span <= n terms."""
    return SAFETY * max(int(n), 1) * torch.finfo(dtype).eps


def scaled_maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max(max|b|, tiny)``: the difference relative to the reference's scale."""
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    scale = max(float(b64.abs().max()) if b64.numel() else 0.0, torch.finfo(torch.float64).tiny)
    return float((a64 - b64).abs().max()) / scale if a64.numel() else 0.0


def assert_scaled_close(a: torch.Tensor, b: torch.Tensor, rtol: float, msg: str = "") -> None:
    """``max|a - b| <= rtol * max|b|`` (one scale for the whole tensor, see module doc)."""
    assert a.shape == b.shape, f"{msg}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    d = scaled_maxdiff(a, b)
    assert d <= rtol, f"{msg}: max|a-b|/max|b| = {d:.3e} > {rtol:.3e}"


def assert_grads_close(g: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], rtol: float,
                       msg: str = "") -> None:
    """Every gradient within ``rtol`` of the reference, scaled by the largest reference gradient.

    One global scale (not per tensor): a parameter whose gradient is ~0 in the reference (an embedding
    row no token used) only carries rounding noise, which is small against the gradient as a whole."""
    scale = max(float(t.abs().max()) for t in ref.values())
    assert scale > 0, f"{msg}: reference gradient is identically zero"
    for name, t in ref.items():
        d = float((g[name].to(torch.float64) - t.to(torch.float64)).abs().max()) / scale
        assert d <= rtol, f"{msg} {name}: max|g-g_ref|/max|g_ref| = {d:.3e} > {rtol:.3e}"


def update_rel_diff(w: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor],
                    start: Mapping[str, torch.Tensor]) -> float:
    """``||Δw - Δw_ref|| / ||Δw_ref||`` over all parameters, with ``Δw = w - start``.

    Compared as whole updates, not per element: Adam divides each gradient element by its own
    ``sqrt(v) + eps``, so an element whose gradient is at rounding-noise level can move by up to
    ``lr`` in either direction; those elements are few and carry no signal, so their share of the
    update's norm is small, while a wrong denominator or a dropped micro-batch changes the update's
    direction as a whole."""
    num = den = 0.0
    for k, w0 in start.items():
        d_ref = ref[k].to(torch.float64) - w0.to(torch.float64)
        d = w[k].to(torch.float64) - w0.to(torch.float64)
        num += float(((d - d_ref) ** 2).sum())
        den += float((d_ref**2).sum())
    assert den > 0, "the reference update did not move the weights"
    return (num / den) ** 0.5

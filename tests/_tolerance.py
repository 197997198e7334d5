"""Tolerances for comparing results computed with different batch shapes or thread counts.

The rule and why it holds (CPU kernels are not batch-invariant; the attention softmax runs in float32
over at most ``T`` keys, so ``tol = SAFETY * n * eps(dtype)``) live in
:mod:`posttrain.diagnostics.tolerance`, which ``posttrain check`` uses as well; this module re-exports
``SAFETY`` and ``shape_rtol`` and adds the assertions the tests compare with.

Measured differences are ~1 eps (float32) relative, while the bugs these tests are about (a
micro-batch's own denominator, a dropped micro-batch, a missing all-reduce) move the result by >= 1e-3
relative — ``tests/learner/test_actor.py::test_split_tolerance_catches_local_normaliser`` breaks the
normaliser on purpose to show the tolerance still catches it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from posttrain.diagnostics.tolerance import SAFETY, shape_rtol

__all__ = ["SAFETY", "assert_grads_close", "assert_scaled_close", "scaled_maxdiff", "shape_rtol", "update_rel_diff"]


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

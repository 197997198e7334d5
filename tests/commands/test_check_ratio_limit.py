"""``posttrain check``'s ``ratio_is_one`` limit follows the length/dtype rule of the test suite
(posttrain/diagnostics/tolerance.py), not a fixed 1e-5: SmolLM2 with 128-token float32 responses
measured max |ratio - 1| = 1.14e-5 at lr = 0."""

import torch

from posttrain.commands.check import ratio_is_one
from posttrain.diagnostics.tolerance import compute_dtype, shape_rtol


def test_limit_at_128_float32_tokens_admits_rounding_and_refuses_a_real_mismatch():
    name, ok, detail = ratio_is_one(1 - 1.14e-5, 1 + 0.9e-5, 0.0, tokens=128, dtype=torch.float32)
    assert (name, ok) == ("ratio_is_one", True), detail
    assert "limit 6.1e-05" in detail  # 4 * 128 * 2**-23
    assert ratio_is_one(1.0, 1 + 1e-3, 0.0, tokens=128, dtype=torch.float32)[1] is False
    assert ratio_is_one(1 - 1e-3, 1.0, 0.0, tokens=128, dtype=torch.float32)[1] is False


def test_a_clipped_token_fails_whatever_the_ratio():
    assert ratio_is_one(1.0, 1.0, 0.01, tokens=128, dtype=torch.float32)[1] is False


def test_limit_grows_with_length_and_never_below_float32_rounding():
    assert shape_rtol(256) == 2 * shape_rtol(128)
    # a float64 model's attention softmax still runs in float32: its limit is float32's
    assert compute_dtype(torch.float64) is torch.float32
    assert ratio_is_one(1.0, 1 + 1.14e-5, 0.0, tokens=128, dtype=torch.float64)[1] is True
    assert compute_dtype(torch.bfloat16) is torch.bfloat16

"""Issue 23 ("One house"): the rebuilt loop floor changes no number.

The golden files (``golden/house_pre23/``) were written by ``_house_golden.py`` from the code before
the first structural change of issue 23 (commit ef037eb), except the sampled held-out metrics
(``heldout_sampled/*`` of ``sync``, ``partial``, ``async_partial`` and ``demo5``), re-recorded after
62795e3 (per-request seeds in ``play_once``, issue 43; ``demo5_avx512``'s are still ef037eb's: no AVX-512
Xeon was at hand to re-record them on). Each case here runs the same command line with the current code and compares what the run left on disk:

- exactly: which trajectories were trained at which step (ids, groups, prompts), their tokens, action
  masks, behaviour versions, statuses, finish reasons, policy lags, old versions and rewards — one
  flipped token or one reordered group fails;
- within the float tolerance of ``tests/_tolerance.py``: behaviour / old / reference log-probs, the
  per-token advantages, every numeric metric the golden run logged (none may go missing), and the
  actor's final weights as a whole update (``update_rel_diff``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _house_golden import (  # noqa: E402
    CALL_COUNTERS,
    CASES,
    GOLDEN_DIR,
    VARIED_CASES,
    capture,
    final_actor,
    run_case,
    threaded,
    timing_dependent,
)
from _kernels import gemm_fingerprint  # noqa: E402
from _tolerance import shape_rtol, update_rel_diff  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# Longest reduction of a forward pass = the hidden size (micro 32, tiny 128; 128 bounds both) in float32;
# |log-prob| <= ~10 on these vocabularies, so log-probs agree to shape_rtol(128) * 10 ~ 6e-4 absolute.
LOGPROB_ATOL = shape_rtol(128) * 10
# Losses, norms and advantages: relative to their scale, the same bound (measured: ~1e-7 between machines).
VALUE_RTOL = 10 * shape_rtol(128)
EXACT = ("step", "traj_id", "group_id", "prompt_id", "status", "finish", "length", "policy_lag", "old_version",
         "token_ids", "action_mask", "behavior_version")


def _golden(case: str) -> tuple[dict[str, np.ndarray], list[dict[str, float]]]:
    with np.load(GOLDEN_DIR / f"{case}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads((GOLDEN_DIR / f"{case}.metrics.json").read_text())


def _start_weights(case: str, tmp_path: Path) -> dict[str, torch.Tensor] | None:
    """The actor's weights before RL (micro cases only: the demo's start is its own SFT result)."""
    from safetensors.torch import load_file

    from posttrain.models import build_char_tokenizer, build_tiny_model

    if case == "demo5":
        return None
    if case in VARIED_CASES:
        sd = load_file(str(tmp_path / "varied_micro" / "model.safetensors"))
    else:
        sd = build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=0,
                              dtype=torch.float32).state_dict()
    return {f"model.safetensors:{k}": v for k, v in sd.items()}


def compare_arrays(new: dict[str, np.ndarray], old: dict[str, np.ndarray]) -> None:
    """The ledger of a run against its golden (see the module docstring for what is exact)."""
    for k in EXACT:
        np.testing.assert_array_equal(new[k], old[k], err_msg=k)
    np.testing.assert_array_equal(np.isnan(new["reward_total"]), np.isnan(old["reward_total"]))
    # Rewards are functions of the (exactly equal) tokens: verdicts and weighted sums, no BLAS, so equal on any CPU.
    np.testing.assert_allclose(new["reward_total"], old["reward_total"], rtol=0, atol=1e-12, equal_nan=True)
    for k in ("behavior_logprob", "old_logprob", "ref_logprob"):
        assert (k in new) == (k in old), f"{k}: present in one run only"
        if k in old:
            np.testing.assert_allclose(new[k], old[k], rtol=0, atol=LOGPROB_ATOL, err_msg=k)
    assert ("advantage" in new) == ("advantage" in old)
    if "advantage" in old and np.abs(old["advantage"]).max() > 0:
        d = np.abs(new["advantage"] - old["advantage"]).max() / np.abs(old["advantage"]).max()
        assert d <= VALUE_RTOL, f"advantage: max|a-b|/max|b| = {d:.3e} > {VALUE_RTOL:.3e}"


def compare_metrics(new: list[dict[str, float]], old: list[dict[str, float]], case: str = "sync",
                    logged_only: tuple[str, ...] = ()) -> None:
    """Every numeric metric of every golden step is logged again, equal within VALUE_RTOL (scale >= 1);
    counters a worker thread's timing decides, and metrics under a prefix of ``logged_only``, are only
    required to be logged."""
    assert len(new) == len(old), f"{len(new)} steps logged, golden has {len(old)}"
    for i, (m, g) in enumerate(zip(new, old, strict=True)):
        missing = sorted(set(g) - set(m))
        assert not missing, f"step {i + 1} lost metrics {missing[:8]}"
        bad = [(k, m[k], v) for k, v in g.items() if not timing_dependent(case, k) and not k.startswith(logged_only)
               and not math.isclose(m[k], v, rel_tol=VALUE_RTOL, abs_tol=VALUE_RTOL)]
        assert not bad, f"step {i + 1}: {len(bad)} metrics moved, e.g. {bad[:6]}"
    if threaded(case):  # which step collected a call's metrics was timing; the run's totals were not
        for k in CALL_COUNTERS:
            want, got = sum(g.get(k, 0.0) for g in old), sum(m.get(k, 0.0) for m in new)
            assert got == want, f"total {k}: {got} != golden {want}"


# demo5 starts from 200 SFT steps of its own. Over that many optimiser steps the rounding of the CPU's GEMM
# kernels (other blockings and reduction orders) moves the SFT weights by more than the float tolerance, and
# the sampled tokens follow (669 of 2560 statuses differ between an AVX2 EPYC and an AVX-512 Xeon). So demo5
# has one golden per GEMM numerics, each recorded by _house_golden.py from the pre-redesign code (ef037eb):
# `demo5` on an AVX2 EPYC, `demo5_avx512` on an AVX-512 Xeon (2026-12-05). They are keyed by what the kernels
# compute, not by the instruction set's name (issue 38): an AMD EPYC reporting AVX-512 runs MKL's AVX2 path
# and reproduces `demo5` exactly, not `demo5_avx512`. The key is tests/_kernels.gemm_fingerprint() (fixed
# float32 GEMMs and ATen kernels at the tiny model's shapes). A fingerprint not listed (the Xeon's was not
# taken when its golden was recorded) is compared in full with the golden whose trajectories it reproduces
# exactly, if one does; otherwise only what the floats cannot move: which steps, prompts, groups and
# trajectory ids the ledger holds, and that every golden metric is still logged. The micro cases start from a
# seeded initialisation and run 5 steps: they compare exactly on every CPU.
GOLDENS = {"demo5": ("demo5", "demo5_avx512")}
GOLDEN_BY_KERNELS = {"demo5": {"fe35f8bdb8b504b1": "demo5"}}  # AMD EPYC: MKL AVX2 path, ATen AVX-512
# Golden metrics recorded before 62795e3 (per-request seeds in play_once) on kernels no session has had since:
# the sampled held-out figures moved with that change and cannot be re-recorded here, so on those kernels they
# are only required to be logged (everything else, and every ledger array, is still compared in full).
# Re-record them on an AVX-512 Xeon (python tests/loop/_house_golden.py) and drop the entry.
LOGGED_ONLY = {"demo5_avx512": ("heldout_sampled/",)}


def golden_for(case: str, fingerprint: str, arrays: dict[str, np.ndarray]) -> str | None:
    """Which golden ``case`` is compared with in full on kernels of ``fingerprint`` (``None``: only the
    float-independent part). A listed fingerprint names its golden whatever the run produced, so a change
    that moves one token fails there; an unlisted one takes the golden whose exact fields the run
    reproduces."""
    if case not in GOLDENS:
        return case
    known = GOLDEN_BY_KERNELS.get(case, {}).get(fingerprint)
    if known is not None:
        return known
    for name in GOLDENS[case]:
        old, _ = _golden(name)
        if all(np.array_equal(arrays[k], old[k]) for k in EXACT):
            return name
    return None


def compare_ids_and_metric_names(new: dict[str, np.ndarray], old: dict[str, np.ndarray],
                                 new_m: list[dict[str, float]], old_m: list[dict[str, float]]) -> None:
    """The float-independent part of the comparison: ledger ids per step, and no golden metric lost."""
    for k in ("step", "traj_id", "group_id", "prompt_id"):
        np.testing.assert_array_equal(new[k], old[k], err_msg=k)
    assert len(new_m) == len(old_m), f"{len(new_m)} steps logged, golden has {len(old_m)}"
    for i, (m, g) in enumerate(zip(new_m, old_m, strict=True)):
        missing = sorted(set(g) - set(m))
        assert not missing, f"step {i + 1} lost metrics {missing[:8]}"


@pytest.mark.parametrize("case", list(CASES))
def test_short_run_matches_the_pre_redesign_golden(case, tmp_path):
    run_case(case, tmp_path / case)
    arrays, metrics = capture(tmp_path / case)
    name = golden_for(case, gemm_fingerprint(), arrays)
    if name is None:  # kernels of unknown numerics that reproduce no golden's tokens
        old_arrays, old_metrics = _golden(case)
        compare_ids_and_metric_names(arrays, old_arrays, metrics, old_metrics)
        print(f"{case}: GEMM fingerprint {gemm_fingerprint()} has no golden; ids and metric names compared")
        return
    old_arrays, old_metrics = _golden(name)
    compare_arrays(arrays, old_arrays)
    compare_metrics(metrics, old_metrics, case, LOGGED_ONLY.get(name, ()))
    start = _start_weights(case, tmp_path)
    if start is not None:
        w = {k: torch.from_numpy(v) for k, v in final_actor(tmp_path / case).items()}
        ref = {k[len("actor/"):]: torch.from_numpy(v) for k, v in old_arrays.items() if k.startswith("actor/")}
        assert set(w) == set(ref)
        assert update_rel_diff(w, ref, {k: v for k, v in start.items() if k in ref}) <= VALUE_RTOL


def test_the_comparison_catches_a_one_token_change_and_a_moved_metric():
    """The tolerances are not vacuous: one flipped token, a log-prob moved by 1e-3 or a loss moved by
    0.2% fails the comparison against the golden it was copied from."""
    arrays, metrics = _golden("sync")
    flipped = dict(arrays, token_ids=arrays["token_ids"].copy())
    flipped["token_ids"][len(flipped["token_ids"]) // 2] += 1
    with pytest.raises(AssertionError, match="token_ids"):
        compare_arrays(flipped, arrays)
    moved = dict(arrays, old_logprob=arrays["old_logprob"] - 1e-3 * arrays["action_mask"])
    with pytest.raises(AssertionError, match="old_logprob"):
        compare_arrays(moved, arrays)
    off = [dict(m) for m in metrics]
    off[1]["loss"] = metrics[1]["loss"] * 1.002 + 2e-3
    with pytest.raises(AssertionError, match="metrics moved"):
        compare_metrics(off, metrics)
    compare_arrays(arrays, arrays)
    compare_metrics(metrics, metrics)
    # the check used on another instruction set still catches a reordered ledger and a lost metric
    swapped = dict(arrays, traj_id=arrays["traj_id"][::-1].copy())
    with pytest.raises(AssertionError, match="traj_id"):
        compare_ids_and_metric_names(swapped, arrays, metrics, metrics)
    lost = [dict(m) for m in metrics]
    del lost[0]["loss"]
    with pytest.raises(AssertionError, match="lost metrics"):
        compare_ids_and_metric_names(arrays, arrays, lost, metrics)
    compare_ids_and_metric_names(arrays, arrays, metrics, metrics)


def test_logged_only_metrics_must_be_logged_but_may_move():
    """demo5_avx512's sampled held-out metrics predate per-request seeds (LOGGED_ONLY): a moved
    ``heldout_sampled/*`` value passes there, a lost one or a moved metric outside the prefix still fails."""
    _, metrics = _golden("demo5")
    step = max(i for i, m in enumerate(metrics) if "heldout_sampled/accuracy" in m)
    moved = [dict(m) for m in metrics]
    moved[step]["heldout_sampled/accuracy"] += 0.1
    with pytest.raises(AssertionError, match="metrics moved"):
        compare_metrics(moved, metrics, "demo5")
    compare_metrics(moved, metrics, "demo5", LOGGED_ONLY["demo5_avx512"])
    lost = [dict(m) for m in moved]
    del lost[step]["heldout_sampled/accuracy"]
    with pytest.raises(AssertionError, match="lost metrics"):
        compare_metrics(lost, metrics, "demo5", LOGGED_ONLY["demo5_avx512"])
    moved[step]["loss"] = metrics[step]["loss"] * 1.01 + 1e-2
    with pytest.raises(AssertionError, match="metrics moved"):
        compare_metrics(moved, metrics, "demo5", LOGGED_ONLY["demo5_avx512"])


def test_golden_is_keyed_by_kernels_not_by_instruction_set():
    """Issue 38 item 0: a listed fingerprint names its golden (a run that moved one token then fails against
    it, it is not re-matched); an unlisted one takes the golden whose tokens the run reproduces, else none."""
    demo, xeon = _golden("demo5")[0], _golden("demo5_avx512")[0]
    assert golden_for("demo5", "fe35f8bdb8b504b1", xeon) == "demo5"
    assert golden_for("demo5", "unlisted", demo) == "demo5"
    assert golden_for("demo5", "unlisted", xeon) == "demo5_avx512"
    moved = dict(demo, token_ids=demo["token_ids"].copy())
    moved["token_ids"][17] += 1
    assert golden_for("demo5", "unlisted", moved) is None
    assert golden_for("sync", "anything", demo) == "sync"


def test_gemm_fingerprint_sees_the_kernels_not_the_threads():
    """The probe is deterministic, ignores the caller's thread count, and moves when the GEMMs round
    differently (float32 matmuls computed through bf16: the kind of change the key must see)."""
    before = torch.get_num_threads()
    fp = gemm_fingerprint()
    try:
        torch.set_num_threads(2)
        assert gemm_fingerprint() == fp
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    precision = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        lowered = gemm_fingerprint()
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = precision
    if lowered == fp:
        pytest.skip("this CPU's oneDNN has no bf16 path for float32 matmuls")
    assert gemm_fingerprint() == fp

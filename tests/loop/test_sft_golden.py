"""Issue 39: ``trainer: sft`` reproduces the golden recorded before it moved onto the learner's primitives
(``learner.forward_backward`` + ``learner.optim_step``), padded and packed, uninterrupted and
interrupted-then-resumed alike.

A case is a short ``posttrain train sft`` on the shipped chats (``builtin:micro``, fixed seed, micro-batches
of 256 tokens so each step runs several, checkpoints every 2 steps), run in-process twice: straight, and with
a SIGINT as step :data:`INTERRUPT_AT` begins (``posttrain train`` exits 130) then ``resume=true``. Its golden,
``golden/sft_<case>.json``, holds every ``metrics.jsonl`` line but ``step_seconds`` (the per-step training
loss, the held-out loss and token accuracy at steps 0, 2, 4), the run directory's files, each checkpoint's
``extra`` but ``wall_seconds`` and its learner-state keys, the log and printed lines of the three commands
(paths and seconds masked) and the final weights' fingerprint (:func:`weight_fingerprint`).

Compared exactly: files, checkpoint steps, formats, learner-state keys, trainer name and cursor, which metrics
each line holds, the counters (:data:`EXACT_METRICS`) and the lines. Within ``VALUE_RTOL`` of
test_house_golden.py (``tests/_tolerance.py``): every other metric, the checkpoints' held-out curves, and the
final weights' update, per parameter, as ``||dw||`` and two projections of ``dw`` on fixed unit directions,
each within ``VALUE_RTOL * ||dw_ref||`` (both move by at most ``||dw - dw_ref||``, the bound
``update_rel_diff`` puts on the whole update).

Regenerate (only from the code *before* a change that must not move these numbers)::

    .venv/bin/python tests/loop/test_sft_golden.py
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
GOLDEN_DIR = HERE / "golden"
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _golden_cli import (  # noqa: E402
    capture_run,
    check_catches_a_moved_loss_and_counter,
    compare_checkpoints_and_metrics,
    sigint_at_call,
    train_lines,
)
from test_house_golden import VALUE_RTOL  # noqa: E402

pytestmark = pytest.mark.timeout(300)

COMMON = ["model.path=builtin:micro", "steps=4", "eval.every=2", "checkpoint_every=2", "sft.batch_size=8",
          "optim.lr=1e-2", "optim.microbatch_tokens=256", "logging.progress=false"]
CASES: dict[str, list[str]] = {"padded": [*COMMON, "sft.packing=false"], "packed": [*COMMON, "sft.packing=true"]}
INTERRUPT_AT = 4
"""The SIGINT comes as step 4 begins: step 3 logged, not checkpointed (the resume drops its line and redoes it)."""
EXACT_METRICS = ("step", "rows_seen", "rows", "tokens", "heldout/tokens", "optimizer_steps", "nonfinite_steps",
                 "zero_grad_steps")
"""Counters: equal on any CPU."""


def cli(run_dir: Path, overrides: list[str], interrupt_at: int | None = None) -> tuple[int, list[str]]:
    """``posttrain train sft run_dir=RUN_DIR OVERRIDES --no-progress`` in-process; ``(exit code, lines)``: the
    ``posttrain`` log messages, then stdout's lines, then stderr's but logging's, masked
    (:func:`_golden_cli.train_lines`). ``interrupt_at=k``: a SIGINT as step ``k`` takes its rows (the ``k``-th
    call of the trainer's ``data_rows``)."""
    import posttrain.loop.sft_training as sft_training

    return train_lines("sft", run_dir, overrides, sigint_at_call(sft_training, "data_rows", interrupt_at))


def start_weights(case: str) -> dict[str, torch.Tensor]:
    """Case ``case``'s model as the trainer builds it (before any step)."""
    from posttrain.loop.builders import build_model
    from posttrain.loop.validate import load_run_config

    cfg = load_run_config("sft", CASES[case])
    torch.manual_seed(cfg.seed)
    _, model = build_model(cfg)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the last checkpoint's ``actor/``."""
    from safetensors.torch import load_file

    ck = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "actor"
    out: dict[str, torch.Tensor] = {}
    for p in sorted(ck.glob("*.safetensors")):
        out.update(load_file(str(p)))
    return out


def weight_fingerprint(final: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``{"update_norm": ||dw|| over all parameters, "params": {name: [||w||, ||dw||, <dw, u1>, <dw, u2>]}}``
    over the tensors ``final`` holds, with ``dw = final - start`` and ``u1``, ``u2`` unit directions drawn per
    parameter from a fixed seed."""
    params: dict[str, list[float]] = {}
    total = 0.0
    for i, name in enumerate(sorted(final)):  # a tied head is saved once
        w, dw = final[name].double(), final[name].double() - start[name].double()
        g = torch.Generator().manual_seed(1000 + i)
        us = [torch.randn(dw.shape, generator=g, dtype=torch.float64) for _ in range(2)]
        params[name] = [float(w.norm()), float(dw.norm()), *(float((dw * u).sum() / u.norm()) for u in us)]
        total += float((dw**2).sum())
    return {"update_norm": total**0.5, "params": params}


def run_case(case: str, tmp: Path) -> dict[str, Any]:
    """Case ``case`` straight in ``tmp/straight`` and interrupted-then-resumed in ``tmp/resumed``: both runs'
    :func:`_golden_cli.capture_run` and weight fingerprints, and the three commands' lines."""
    rc, straight = cli(tmp / "straight", CASES[case])
    assert rc == 0, f"{case}: posttrain train exited {rc}: {straight}"
    rc, stopped = cli(tmp / "resumed", CASES[case], interrupt_at=INTERRUPT_AT)
    assert rc == 130, f"{case}: the interrupted posttrain train exited {rc}, not 130: {stopped}"
    rc, resumed = cli(tmp / "resumed", [*CASES[case], "resume=true"])
    assert rc == 0, f"{case}: the resumed posttrain train exited {rc}: {resumed}"
    start = start_weights(case)
    return {"runs": {name: {**capture_run(tmp / name), "weights": weight_fingerprint(final_weights(tmp / name), start)}
                     for name in ("straight", "resumed")},
            "lines": {"straight": straight, "interrupted": stopped, "resumed": resumed}}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=VALUE_RTOL, abs_tol=VALUE_RTOL)


def compare_run(new: dict[str, Any], old: dict[str, Any]) -> None:
    """One run's :func:`_golden_cli.capture_run` + fingerprint against the golden's (module docstring)."""
    assert new["files"] == old["files"], f"files: {sorted(set(new['files']) ^ set(old['files']))}"
    compare_checkpoints_and_metrics(new, old, EXACT_METRICS, _close)
    w, ref = new["weights"], old["weights"]
    tol = VALUE_RTOL * ref["update_norm"]
    assert sorted(w["params"]) == sorted(ref["params"])
    assert abs(w["update_norm"] - ref["update_norm"]) <= tol, (w["update_norm"], ref["update_norm"])
    for name, (wn, *upd) in ref["params"].items():
        got_wn, *got_upd = w["params"][name]
        assert _close(got_wn, wn), f"{name}: ||w|| {got_wn} != {wn}"
        assert all(abs(a - b) <= tol for a, b in zip(got_upd, upd, strict=True)), f"{name}: dw {got_upd} != {upd}"


@pytest.mark.parametrize("case", list(CASES))
def test_sft_matches_the_pre_primitives_golden(case: str, tmp_path: Path) -> None:
    golden = json.loads((GOLDEN_DIR / f"sft_{case}.json").read_text())
    got = run_case(case, tmp_path)
    assert got["lines"] == golden["lines"]
    assert "resumed <RUN> at step 2" in golden["lines"]["resumed"]
    for name in ("straight", "resumed"):
        compare_run(got["runs"][name], golden["runs"][name])
    compare_run(got["runs"]["resumed"], golden["runs"]["straight"])  # the resume is the uninterrupted run


def test_the_comparison_catches_a_moved_loss_a_counter_and_another_update() -> None:
    """Not vacuous: a loss moved by 0.2%, a cursor off by one or one parameter's update moved by a tenth of the
    whole update's norm fails the comparison against the golden it was copied from."""
    golden = json.loads((GOLDEN_DIR / "sft_packed.json").read_text())["runs"]["straight"]
    check_catches_a_moved_loss_and_counter(compare_run, golden, "rows_seen")
    off = json.loads(json.dumps(golden))
    name = "model.layers.0.self_attn.q_proj.weight"
    off["weights"]["params"][name][2] += 0.1 * golden["weights"]["update_norm"]
    with pytest.raises(AssertionError, match="dw"):
        compare_run(off, golden)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    with tempfile.TemporaryDirectory() as d:
        for case in sys.argv[1:] or list(CASES):
            got = run_case(case, Path(d) / case)
            if got["runs"]["resumed"]["files"] != got["runs"]["straight"]["files"]:
                raise RuntimeError(f"{case}: the resumed run's files differ from the uninterrupted run's")
            (GOLDEN_DIR / f"sft_{case}.json").write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
            print(f"recorded sft_{case}")

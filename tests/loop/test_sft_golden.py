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

import contextlib
import io
import json
import logging
import math
import os
import re
import signal
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
LOG_LINE = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def _mask(text: str, run_dir: Path) -> str:
    return re.sub(r" in \d+ s;", " in N s;", text.replace(str(run_dir), "<RUN>"))


def cli(run_dir: Path, overrides: list[str], interrupt_at: int | None = None) -> tuple[int, list[str]]:
    """``posttrain train sft run_dir=RUN_DIR OVERRIDES --no-progress`` in-process; ``(exit code, lines)``: the
    ``posttrain`` log messages, then stdout's lines, then stderr's but logging's, masked. ``interrupt_at=k``: a
    SIGINT as step ``k`` takes its rows (the ``k``-th call of the trainer's ``data_rows``)."""
    import posttrain.loop.sft_training as sft_training
    from posttrain.cli import main

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    real, calls = sft_training.data_rows, [0]

    def data_rows(n: int, batch_size: int, cursor: int, seed: int) -> list[int]:
        calls[0] += 1
        if calls[0] == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
        return real(n, batch_size, cursor, seed)

    handler, logger = Keep(level=logging.INFO), logging.getLogger("posttrain")
    out, err = io.StringIO(), io.StringIO()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    sft_training.data_rows = data_rows  # type: ignore[assignment]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["train", "sft", f"run_dir={run_dir}", *overrides, "--no-progress"])
    finally:
        sft_training.data_rows = real  # type: ignore[assignment]
        logger.removeHandler(handler)
        logger.setLevel(level)
    printed = [*out.getvalue().splitlines(), *(e for e in err.getvalue().splitlines() if not LOG_LINE.match(e))]
    return rc, [_mask(line, run_dir) for line in [*records, *printed]]


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


def capture(run_dir: Path) -> dict[str, Any]:
    """What a finished run left on disk: ``metrics`` (each line but ``step_seconds``), ``files``,
    ``checkpoints`` (``extra`` but ``wall_seconds``, learner-state keys)."""
    metrics = [{k: v for k, v in json.loads(line).items() if k != "step_seconds"}
               for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    checkpoints = {}
    for ck in sorted((run_dir / "checkpoints").glob("step_*")):
        meta = json.loads((ck / "meta.json").read_text())
        state = torch.load(ck / "learner_state.pt", weights_only=True)
        checkpoints[ck.name] = {"step": meta["step"], "format": meta["format"],
                                "extra": {k: v for k, v in meta["extra"].items() if k != "wall_seconds"},
                                "learner_state": {k: sorted(v) for k, v in state.items()}}
    return {"metrics": metrics, "files": files, "checkpoints": checkpoints}


def run_case(case: str, tmp: Path) -> dict[str, Any]:
    """Case ``case`` straight in ``tmp/straight`` and interrupted-then-resumed in ``tmp/resumed``: both runs'
    :func:`capture` and weight fingerprints, and the three commands' lines."""
    rc, straight = cli(tmp / "straight", CASES[case])
    assert rc == 0, f"{case}: posttrain train exited {rc}: {straight}"
    rc, stopped = cli(tmp / "resumed", CASES[case], interrupt_at=INTERRUPT_AT)
    assert rc == 130, f"{case}: the interrupted posttrain train exited {rc}, not 130: {stopped}"
    rc, resumed = cli(tmp / "resumed", [*CASES[case], "resume=true"])
    assert rc == 0, f"{case}: the resumed posttrain train exited {rc}: {resumed}"
    start = start_weights(case)
    return {"runs": {name: {**capture(tmp / name), "weights": weight_fingerprint(final_weights(tmp / name), start)}
                     for name in ("straight", "resumed")},
            "lines": {"straight": straight, "interrupted": stopped, "resumed": resumed}}


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=VALUE_RTOL, abs_tol=VALUE_RTOL)


def compare_run(new: dict[str, Any], old: dict[str, Any]) -> None:
    """One run's :func:`capture` + fingerprint against the golden's (module docstring)."""
    assert new["files"] == old["files"], f"files: {sorted(set(new['files']) ^ set(old['files']))}"
    assert sorted(new["checkpoints"]) == sorted(old["checkpoints"])
    for name, g in old["checkpoints"].items():
        c = new["checkpoints"][name]
        for k in ("step", "format", "learner_state"):
            assert c[k] == g[k], f"{name}: {k} {c[k]} != {g[k]}"
        assert sorted(c["extra"]) == sorted(g["extra"]), f"{name}: extra keys {sorted(c['extra'])}"
        assert (c["extra"]["trainer"], c["extra"]["cursor"]) == (g["extra"]["trainer"], g["extra"]["cursor"]), name
        assert [s for s, _ in c["extra"]["curve"]] == [s for s, _ in g["extra"]["curve"]], f"{name}: curve steps"
        assert all(_close(v, w) for (_, v), (_, w) in zip(c["extra"]["curve"], g["extra"]["curve"], strict=True)), (
            f"{name}: curve {c['extra']['curve']} != {g['extra']['curve']}")
    assert len(new["metrics"]) == len(old["metrics"]), f"{len(new['metrics'])} lines, golden {len(old['metrics'])}"
    for m, g in zip(new["metrics"], old["metrics"], strict=True):
        assert sorted(m) == sorted(g), f"step {g['step']}: metrics {sorted(set(m) ^ set(g))} added or lost"
        moved = [(k, m[k], v) for k, v in g.items()
                 if (m[k] != v if k in EXACT_METRICS or v is None else not _close(m[k], v))]
        assert not moved, f"step {g['step']}: {len(moved)} metrics moved, e.g. {moved[:6]}"
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
    compare_run(golden, golden)
    off = json.loads(json.dumps(golden))
    line = next(m for m in off["metrics"] if "loss" in m)
    line["loss"] = line["loss"] * 1.002 + 2e-3
    with pytest.raises(AssertionError, match="metrics moved"):
        compare_run(off, golden)
    off = json.loads(json.dumps(golden))
    next(m for m in off["metrics"] if "rows_seen" in m)["rows_seen"] += 1
    with pytest.raises(AssertionError, match="metrics moved"):
        compare_run(off, golden)
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

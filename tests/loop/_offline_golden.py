"""Issue 39 ("trainers share one run lifecycle"): goldens of the offline pair trainers, recorded *before* the
offline preference trainer (``trainer: preference``, pairs from ``preference.data``) and the reward-model
trainer (``trainer: reward_model``) moved onto :mod:`posttrain.loop.lifecycle`, so the port can show it
changed no number, file or message.

Each case is a short ``posttrain train RECIPE`` (fixed seed, a few steps, a builtin model, a checkpoint
before the last step) run in-process twice:

- ``straight``: uninterrupted;
- ``resumed``: a SIGINT as step ``k`` begins (the case's third field; ``posttrain train`` exits 130),
  then the same command with ``resume=true``.

A case's golden is ``<case>.json`` (every ``metrics.jsonl`` line but ``step_seconds``, the run directory's
files, each checkpoint's ``meta.json`` ``extra`` but ``wall_seconds`` and its learner-state keys, the
reward model's rendering files, and the ``posttrain`` log messages and printed lines of the three
commands, run paths and seconds masked) and ``<case>.npz`` (a few parameter tensors of the model as built, ``start/``, and of the
last checkpoint's ``actor/``, ``final/``). No rollout is sampled and the runs are a few steps long, so the
floats agree across CPUs within ``tests/_tolerance.py`` (the comparison: test_offline_trainer_golden.py).

Regenerate (only from the code *before* a change that must not move these numbers)::

    .venv/bin/python tests/loop/_offline_golden.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _golden_cli import capture_run, sigint_at_call, train_lines

HERE = Path(__file__).resolve().parent
GOLDEN_DIR = HERE / "golden" / "pre39_offline"

CASES: dict[str, tuple[str, list[str], int]] = {
    # DPO on the shipped toy pairs, builtin:tiny: reference log-probs, checkpoints at 2 and 4; the SIGINT comes
    # as step 4 begins (step 3 logged, not checkpointed: the resume drops its line and takes it again).
    "dpo": ("dpo", ["steps=4", "checkpoint_every=2", "eval.every=2", "logging.progress=false"], 4),
    # A reference-free loss (no frozen copy) on builtin:micro; the last step (3) is not a checkpoint_every one
    # and the SIGINT comes as it begins (nothing to drop).
    "simpo": ("dpo", ["steps=3", "checkpoint_every=2", "eval.every=2", "model.path=builtin:micro",
                      "preference.loss=simpo", "preference.kwargs={}", "optim.lr=3e-3", "logging.progress=false"], 3),
    # The Bradley-Terry reward model on the shipped sum pairs, builtin:tiny; it also writes reward_model/.
    "reward_model": ("reward_model", ["steps=4", "checkpoint_every=2", "eval.every=2", "logging.progress=false"], 4),
}
WEIGHTS = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "score.weight")
"""The parameters kept (those the case's model has): an embedding, an attention projection, the last norm and
the reward model's head."""
TIMING = ("step_seconds",)
"""Metrics a clock decides: not kept."""


def cli(recipe: str, run_dir: Path, overrides: list[str], interrupt_at: int | None = None) -> tuple[int, list[str]]:
    """``posttrain train RECIPE run_dir=RUN_DIR OVERRIDES --no-progress`` in-process; ``(exit code, lines)``:
    the ``posttrain`` log messages, then the lines printed to stdout, then to stderr (but logging's), masked
    (:func:`_golden_cli.train_lines`). ``interrupt_at=k``: a SIGINT as the ``k``-th optimiser step of the run
    begins (the learners' ``Trainer.train``, which every offline trainer calls once per step)."""
    from posttrain.learner.trainer import Trainer

    return train_lines(recipe, run_dir, overrides, sigint_at_call(Trainer, "train", interrupt_at))


def run_straight(case: str, run_dir: Path) -> list[str]:
    """Case ``case`` uninterrupted in ``run_dir``; its lines (:func:`cli`)."""
    recipe, overrides, _ = CASES[case]
    rc, lines = cli(recipe, run_dir, overrides)
    if rc != 0:
        raise RuntimeError(f"{case}: posttrain train exited {rc}")
    return lines


def run_resumed(case: str, run_dir: Path) -> tuple[list[str], list[str]]:
    """Case ``case`` interrupted as its step ``k`` begins (:data:`CASES`), then resumed; the lines of the
    interrupted command and of the resumed one."""
    recipe, overrides, k = CASES[case]
    rc, stopped = cli(recipe, run_dir, overrides, interrupt_at=k)
    if rc != 130:
        raise RuntimeError(f"{case}: the interrupted posttrain train exited {rc}, not 130")
    rc, lines = cli(recipe, run_dir, [*overrides, "resume=true"])
    if rc != 0:
        raise RuntimeError(f"{case}: the resumed posttrain train exited {rc}")
    return stopped, lines


def capture(run_dir: Path) -> dict[str, Any]:
    """What a finished run left on disk (:func:`_golden_cli.capture_run`: ``metrics`` but :data:`TIMING`,
    ``files``, ``checkpoints``) and ``render`` (each rendering file's content)."""
    got = capture_run(run_dir, TIMING)
    return {**got, "render": {f: (run_dir / f).read_text() for f in got["files"] if f.endswith("reward_model.json")}}


def final_weights(run_dir: Path) -> dict[str, np.ndarray]:
    """The :data:`WEIGHTS` of the last checkpoint's ``actor/``."""
    from safetensors.numpy import load_file

    ck = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "actor"
    out: dict[str, np.ndarray] = {}
    for p in sorted(ck.glob("*.safetensors")):
        out.update({k: v for k, v in load_file(str(p)).items() if k in WEIGHTS})
    return out


def start_weights(case: str) -> dict[str, np.ndarray]:
    """The :data:`WEIGHTS` of case ``case``'s model as its trainer builds it (before any step)."""
    import torch

    from posttrain.loop.validate import load_run_config

    recipe, overrides, _ = CASES[case]
    cfg = load_run_config(recipe, overrides)
    torch.manual_seed(cfg.seed)
    if cfg.trainer == "reward_model":
        from posttrain.loop.reward_model_training import build_reward_model

        _, model = build_reward_model(cfg)
    else:
        from posttrain.loop.builders import build_model

        _, model = build_model(cfg)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if k in WEIGHTS}


def record(case: str, tmp: Path) -> None:
    """Run case ``case`` both ways and write its golden files under :data:`GOLDEN_DIR`."""
    lines = run_straight(case, tmp / case)
    stopped, resumed = run_resumed(case, tmp / f"{case}_resumed")
    got = capture(tmp / case)
    if capture(tmp / f"{case}_resumed")["files"] != got["files"]:
        raise RuntimeError(f"{case}: the resumed run's files differ from the uninterrupted run's")
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    lines = {"straight": lines, "interrupted": stopped, "resumed": resumed}
    (GOLDEN_DIR / f"{case}.json").write_text(json.dumps({**got, "lines": lines}, indent=1, sort_keys=True) + "\n")
    np.savez_compressed(GOLDEN_DIR / f"{case}.npz", **{f"start/{k}": v for k, v in start_weights(case).items()},
                        **{f"final/{k}": v for k, v in final_weights(tmp / case).items()})


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    with tempfile.TemporaryDirectory() as d:
        for name in sys.argv[1:] or list(CASES):
            record(name, Path(d))
            print(f"recorded {name}")

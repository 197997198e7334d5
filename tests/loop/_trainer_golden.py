"""Issue 39 ("one learner API"): golden ledgers and metrics of the trainers that reach the learner outside
the RL update, recorded *before* the learner became primitives (forward_backward / optim_step), so the
refactor can show it changed no number (the sampled held-out metrics, ``heldout_sampled/*``, were
re-recorded after 62795e3: per-request seeds in ``play_once``, issue 43). The SFT warm-up's golden is
``demo5`` of ``_house_golden.py`` (200 warm-up steps, then GRPO); this module adds:

- ``online_dpo``: ``trainer: preference`` with ``preference.online: true`` (recipe dpo_online): a 30-step
  SFT warm-up, then 3 online DPO steps whose pairs come from the run's own sampled groups.

The SFT warm-up and the sampled pairs run through the CPU's GEMM kernels, so the golden holds for the
kernels it was recorded on (``GOLDEN_KERNELS``, :func:`tests._kernels.gemm_fingerprint`); on others the
test compares the float-independent part only (as ``demo5`` does).

Regenerate (only from the code *before* a change that must not move these numbers)::

    .venv/bin/python tests/loop/_trainer_golden.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from _house_golden import capture, final_actor  # noqa: E402

GOLDEN_DIR = HERE / "golden" / "pre39"
GOLDEN_KERNELS = "fe35f8bdb8b504b1"  # AMD EPYC, MKL AVX2 path (tests/_kernels.gemm_fingerprint)
CASES: dict[str, tuple[str, list[str]]] = {
    "online_dpo": ("dpo_online", ["steps=3", "sft.steps=30", "sampling.prompts_per_step=8", "eval.every=3",
                                  "eval.size=20", "logging.progress=false"]),
}


def run_case(name: str, run_dir: Path) -> None:
    """``posttrain train RECIPE run_dir=... OVERRIDES`` in-process (fails loudly on a non-zero exit)."""
    from posttrain.cli import main

    recipe, overrides = CASES[name]
    rc = main(["train", recipe, f"run_dir={run_dir}", *overrides, "--no-progress"])
    if rc != 0:
        raise RuntimeError(f"{name}: posttrain train exited {rc}")


def record(name: str, tmp: Path) -> None:
    """Run case ``name`` and write its golden files under :data:`GOLDEN_DIR`."""
    run_case(name, tmp / name)
    arrays, metrics = capture(tmp / name)
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(GOLDEN_DIR / f"{name}.npz", **arrays,
                        **{f"actor/{k}": v for k, v in final_actor(tmp / name).items()})
    (GOLDEN_DIR / f"{name}.metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        for case in sys.argv[1:] or list(CASES):
            record(case, Path(d))
            print(f"recorded {case}")

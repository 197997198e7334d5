"""``eval.heldout_seed``: every seed of a recipe evaluated on the same held-out problems (issue 43), the
training problems still disjoint from them; unset, each seed draws its own set (as before)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.diagnostics.fairness import identity
from posttrain.evaluation.heldout import HeldoutRun
from posttrain.loop.builders import build_model, build_task
from posttrain.loop.parts import build_parts
from posttrain.loop.validate import load_run_config

BASE = ["model.path=builtin:micro", "eval.size=12"]


def _heldout_prompts(seed: int, *extra: str) -> list[str]:
    cfg = load_run_config("grpo", [*BASE, f"seed={seed}", *extra])
    tok, model = build_model(cfg)
    hr = HeldoutRun.from_config(cfg, model, tok)
    try:
        return [ex.prompt for ex in hr.heldout]
    finally:
        hr.close()


def test_fixed_heldout_seed_gives_every_seed_the_same_problems() -> None:
    a, b = _heldout_prompts(1, "eval.heldout_seed=0"), _heldout_prompts(2, "eval.heldout_seed=0")
    assert a == b == _heldout_prompts(0)  # seed 0's own set: recipes that fix 0 keep seed 0's figures
    assert _heldout_prompts(1) != _heldout_prompts(2)  # unset: the run's seed draws the set, as before


def test_run_parts_use_it_and_training_stays_disjoint(tmp_path: Path) -> None:
    cfg = load_run_config("grpo", [*BASE, "seed=3", "eval.heldout_seed=0"])
    parts = build_parts(cfg, tmp_path)
    try:
        held = {ex.prompt for ex in parts.heldout}
        assert held == set(_heldout_prompts(0))
        train = {ex.prompt for ex in build_task(cfg).examples("train", 200, seed=cfg.seed)}
        assert not held & train
    finally:
        parts.engine.close() if hasattr(parts.engine, "close") else None


@pytest.mark.parametrize("value,shown", [(None, False), (0, True)])
def test_compare_identity_names_a_fixed_set(tmp_path: Path, value: int | None, shown: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from posttrain.diagnostics import fairness

    for name in ("_tokenizer_identity", "_prompt_rendering", "_verifiers"):  # they read the ledger; not tested here
        monkeypatch.setattr(fairness, name, lambda *a: "-")
    ev = {"size": 12} if value is None else {"size": 12, "heldout_seed": value}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"path": "builtin:micro"}, "task": {"name": "x"},
                                                         "eval": ev}))
    assert ("heldout_seed=0" in identity(tmp_path)["held-out set"]) is shown

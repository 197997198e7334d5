"""The keys a shipped recipe leaves to the command line, for tests that load every shipped recipe.

A recipe may require a key it cannot ship: ``smollm2_distill_word_problems`` names no distillation teacher
(the teacher is the user's RL checkpoint), so loading it alone is refused naming ``loss.distill.teacher``.
Tests that load each shipped recipe add :func:`with_required`'s overrides.
"""

from __future__ import annotations

from posttrain.config import ModelConfig
from posttrain.config.loading import read_recipe


def with_required(recipe: str, overrides: list[str]) -> list[str]:
    """``overrides`` plus a value for each key ``recipe`` leaves to the command line: a ``loss.distill``
    without a teacher gets the student's own model (``model.path`` after ``overrides``) as its teacher,
    which shares its tokenizer and, for a builtin, its initialisation (a teacher that gives no signal)."""
    data, _ = read_recipe(recipe, overrides)
    distill = (data.get("loss") or {}).get("distill")
    if isinstance(distill, dict) and "teacher" not in distill:
        student = (data.get("model") or {}).get("path") or ModelConfig().path
        return [*overrides, f"loss.distill.teacher={student}"]
    return list(overrides)

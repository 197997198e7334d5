"""The keys a shipped recipe leaves to the command line, for tests that load every shipped recipe.

A recipe may require a key it cannot ship: ``smollm2_distill_word_problems`` names no distillation teacher
(the teacher is the user's RL checkpoint), so loading it alone is refused naming ``loss.distill.teacher``; a later
stage of a pipeline (``smollm2_instruction_following_ei_rl``) starts from the checkpoint an earlier stage writes
(``model.path=runs/<stage>/checkpoints/step_N/actor``), refused while that run has not been made. Tests that load
each shipped recipe add :func:`with_required`'s overrides.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.config import ModelConfig
from posttrain.config.loading import read_recipe


def _stage_output(path: object) -> bool:
    """Whether ``path`` is a checkpoint's policy that an earlier stage writes and this machine lacks."""
    p = Path(str(path))
    return p.name == "actor" and p.parent.parent.name == "checkpoints" and not p.is_dir()


def with_required(recipe: str, overrides: list[str]) -> list[str]:
    """``overrides`` plus a value for each key ``recipe`` leaves to the command line: a ``loss.distill``
    without a teacher gets the student's own model (``model.path`` after ``overrides``) as its teacher,
    which shares its tokenizer and, for a builtin, its initialisation (a teacher that gives no signal); a
    ``model.path`` that an earlier stage's run writes (``.../checkpoints/step_N/actor``, not made here) gets
    the default model."""
    data, _ = read_recipe(recipe, overrides)
    out = list(overrides)
    if _stage_output((data.get("model") or {}).get("path")):
        out.append(f"model.path={ModelConfig().path}")
        data, _ = read_recipe(recipe, out)
    distill = (data.get("loss") or {}).get("distill")
    if isinstance(distill, dict) and "teacher" not in distill:
        student = (data.get("model") or {}).get("path") or ModelConfig().path
        return [*out, f"loss.distill.teacher={student}"]
    return out

"""The SFT warm-up before RL (``sft.steps`` > 0): supervised steps on reference responses.

Single-turn, a demonstration is one pair (rendered prompt, the example's ``meta['answer']`` + EOS); with
``env.name``, the environment's demonstration, one pair per assistant turn. ``sft.batch_size`` demonstrations
are drawn per step with replacement (seeded by ``seed``) from ``sft.examples`` training examples, each with all
its turns (a call and the answer that follows it train in the same step; ``sft.warmup_draw: turn`` draws single
turns instead); the per-step losses go to ``sft_losses.json``. The reference model and the engine then take the warmed weights, so the step-0
held-out evaluation and the KL are measured from them. The warm-up's problems are training ones,
less any that states a held-out problem in other words (:func:`warmup_examples`): no problem of the
run's held-out sets is ever demonstrated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from rich.progress import Progress

    from posttrain.config import RunConfig
    from posttrain.envs.task import Task, TaskExample
    from posttrain.loop.parts import Parts


def reference_answer(task: Task, ex: TaskExample) -> str:
    """The model-free reference response of an example (``meta['answer']``), for SFT warm-up."""
    ans = ex.meta.get("answer")
    if ans is None:
        raise ValueError(f"task {task.name!r}: example {ex.prompt_id!r} has no meta['answer'] for the SFT warm-up")
    return str(ans)


def warmup_examples(task: Task, cfg: RunConfig, heldout: Sequence[TaskExample]) -> list[TaskExample]:
    """The warm-up's problems: ``sft.examples`` of ``task``'s *training* split (seed ``seed + 12345``;
    the split is by problem, so none is a held-out statement), less any that states the same problem as
    one of ``heldout`` in other words (``task.problem_key`` when the task has one: ``b*a`` for a held-out
    ``a*b``). A warm-up never demonstrates a problem the run is evaluated on."""
    key: Callable[[str], str] = getattr(task, "problem_key", None) or str
    held = {key(ex.prompt) for ex in heldout}
    return [ex for ex in task.examples("train", cfg.sft.examples, seed=cfg.seed + 12_345) if key(ex.prompt) not in held]


def sft_warmup(parts: Parts, run_dir: Path, progress: Progress | None = None) -> None:
    """``parts.cfg.sft.steps`` SFT steps on the driver's copy of the model (:func:`posttrain.learner.sft.run_sft`
    over the learner's ``driver_context()``: the answer NLL, the warm-up's own optimiser; with learner ranks
    the warmed weights reach them before their next call; a ``rich`` ``progress`` bar when given), the losses
    written to ``run_dir/sft_losses.json``; then the reference model and the engine get its weights."""
    from posttrain.learner.sft import run_sft
    from posttrain.loop.parts import sync_weights

    cfg = parts.cfg
    demos = warmup_demonstrations(parts)
    g = torch.Generator().manual_seed(cfg.seed)
    bar = progress.add_task("SFT warm-up", total=cfg.sft.steps) if progress else None

    if cfg.sft.warmup_draw == "turn":  # single turns, as drawn before whole demonstrations (tool_calc's curve)
        demos = [[pair] for demo in demos for pair in demo]

    def batches(s: int) -> list[tuple[list[int], list[int]]]:
        idx = torch.randint(len(demos), (cfg.sft.batch_size,), generator=g).tolist()
        return [pair for i in idx for pair in demos[i]]

    def on_step(s: int, loss: float) -> None:
        if progress is not None and bar is not None:
            progress.update(bar, advance=1, description=f"SFT warm-up loss {loss:.3f}")

    losses = run_sft(parts.learner, batches, steps=cfg.sft.steps, lr=cfg.sft.lr, pad_token_id=parts.pad_token_id,
                     on_step=on_step)
    (run_dir / "sft_losses.json").write_text(json.dumps(losses))
    if parts.ref_model is not None:
        parts.ref_model.load_state_dict(parts.learner.weights_for_rollout())  # plain names (LoRA merged)
    sync_weights(parts)


def warmup_demonstrations(parts: Parts) -> list[list[tuple[list[int], list[int]]]]:
    """The warm-up's demonstrations over :func:`warmup_examples` (none of the run's held-out sets), each a list of
    (prompt ids, response ids) pairs: single-turn, one pair (the rendered prompt and ``meta['answer']`` + EOS);
    with ``env.name``, the environment's demonstration, one pair per assistant turn in turn order
    (:func:`posttrain.loop.episode_rollout.sft_demonstrations`)."""
    from posttrain.loop.heldout import eval_splits, split_examples

    cfg = parts.cfg
    held = [ex for split in eval_splits(parts.task) for ex in split_examples(parts, split)]
    pool = warmup_examples(parts.task, cfg, held)
    if cfg.env.name is not None:  # multi-turn: the environment's demonstrations, one pair per turn
        from posttrain.loop.episode_rollout import EpisodeRollout, sft_demonstrations
        from posttrain.loop.rollout_stage import RolloutStage

        return sft_demonstrations(EpisodeRollout(cfg, parts, RolloutStage.from_config(cfg)), pool)
    tok = parts.tokenizer
    return [[(parts.renderer.ids(ex), tok(reference_answer(parts.task, ex)).input_ids + [tok.eos_token_id])]
            for ex in pool]


__all__ = ["reference_answer", "sft_warmup", "warmup_demonstrations", "warmup_examples"]

"""The run lifecycle of a trainer that steps over a dataset: open, lock, resume, step, record, checkpoint, close.

A trainer program supplies its parts (model, tokenizer, the learners'
:class:`~posttrain.learner.trainer.Trainer` or anything with its ``state_dict`` / ``load_state_dict``), a
step function and an evaluation; :class:`RunLifecycle` does the rest, the same for every such trainer::

    with locked_run_dir(cfg) as run_dir:            # prepared, locked; a fresh run never overwrites another
        parts = build(...)                          # the trainer's model, tokenizer, optimiser
        with RunLifecycle(cfg, run_dir, parts, curve=...) as run:   # resume=true: restore; config.yaml
            result = run.run(step_fn, evaluate, progress=progress)

:meth:`RunLifecycle.run` evaluates at step 0 (a fresh run), then for each step ``step + 1 .. cfg.steps``:
checks for a swallowed Ctrl-C (:func:`~posttrain.loop.interrupt.raise_if_interrupted`), calls
``step_fn(step, cursor)`` (which takes its rows at the data cursor, e.g. :func:`data_rows`, and updates the
model), records its metrics with ``step_seconds`` and the cursor in ``metrics.jsonl`` (and the trackers of
``logging.*``), evaluates every ``eval.every`` steps and at the last, and checkpoints every
``checkpoint_every`` steps and at the last (at step 0 too when ``steps=0``).

A checkpoint (:func:`~posttrain.learner.checkpoint.save_checkpoint`, atomic) holds ``actor/`` (the model with
its tokenizer, loadable by ``from_pretrained`` and ``posttrain eval``), the optimiser state under
``learner_state[parts.state_key]``, the RNG states and ``extra``: ``trainer`` (the program's name),
``cursor``, ``wall_seconds`` and ``curve`` (the held-out curve so far). ``resume=true`` restores the newest
checkpoint that loads (an unreadable one falls back to the previous, with a warning), drops the
``metrics.jsonl`` lines after its step and continues: the same rows in the same order
(the cursor), the same optimiser state and RNG, so the same losses as an uninterrupted run. A Ctrl-C leaves
the last complete checkpoint as it was (a checkpoint being written is discarded). The two halves on their own,
:func:`save_run_checkpoint` and :func:`restore_run_checkpoint`, are what ``posttrain check`` round-trips.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import torch

from posttrain.config import RunConfig, dump_config
from posttrain.learner.settings import BatchingSettings, OptimizerSettings
from posttrain.learner.trainer import Trainer
from posttrain.loop.interrupt import raise_if_interrupted
from posttrain.loop.metrics_log import MetricsLog

if TYPE_CHECKING:
    from rich.progress import Progress

    from posttrain.models.tokenizer_protocol import Tokenizer

log = logging.getLogger("posttrain")


class Stateful(Protocol):
    """What the lifecycle checkpoints besides the weights: the learners' ``Trainer`` (optimiser, schedule,
    shuffle generator, step count) or anything that saves and loads its state the same way."""

    def state_dict(self) -> dict[str, object]:
        """The state to save."""
        ...

    def load_state_dict(self, state: Mapping[str, object], *, owner: str) -> None:
        """Load a saved state; ``ValueError`` naming ``owner`` when it lacks a key."""
        ...


@dataclasses.dataclass
class RunParts:
    """What a trainer program trains: ``model`` (saved as the checkpoint's ``actor/``), its ``tokenizer``, its
    ``trainer`` (:class:`Stateful`) and its ``name`` (``extra["trainer"]``); ``state_key`` is the trainer
    state's key in ``learner_state`` and ``label`` the progress bar's (both default ``name``)."""

    name: str
    model: torch.nn.Module
    tokenizer: Tokenizer
    trainer: Stateful
    state_key: str = ""
    label: str = ""

    def __post_init__(self) -> None:
        self.state_key = self.state_key or self.name
        self.label = self.label or self.name


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one step did: the data ``cursor`` after it (rows consumed since the start) and its ``metrics``
    (the loss, the optimiser's, ``lr`` ...; None is written as null; ``loss`` is shown on the progress bar)."""

    cursor: int
    metrics: Mapping[str, float | None]


@dataclasses.dataclass(frozen=True)
class Curve:
    """The held-out curve a run reports: ``key``, the evaluation metric it follows, and its ``name`` in the
    closing lines; ``cursor_key``: the step metric recording the data cursor (``rows_seen``, ``pairs_seen``)."""

    key: str
    name: str
    cursor_key: str = "rows_seen"


@dataclasses.dataclass
class RunResult:
    """What a run did: ``step`` (steps done), ``wall_seconds`` (over every try of a resumed run), the held-out
    ``curve`` (``(step, value)`` of ``curve_name``) and ``stopped`` (a reason, or None). Meets ``posttrain
    train``'s ``TrainerResult``."""

    step: int
    wall_seconds: float
    curve_name: str
    curve: list[tuple[int, float]]
    stopped: str | None = None

    def summary_lines(self) -> list[str]:
        """The lines ``posttrain train`` prints at the end."""
        pts = ", ".join(f"{s}:{v:.3f}" for s, v in self.curve)
        lines = [f"done: {self.step} steps in {self.wall_seconds:.0f} s; {self.curve_name} by step {pts}"]
        if len(self.curve) >= 2:
            lines.append(f"  {self.curve_name}: {self.curve[0][1]:.3f} -> {self.curve[-1][1]:.3f}")
        if self.stopped:
            lines.append(f"stopped early: {self.stopped}")
        return lines


def data_rows(n: int, batch_size: int, cursor: int, seed: int) -> list[int]:
    """Indices of the ``batch_size`` rows (of ``n``) at data cursor ``cursor``: pass ``k = cursor // n`` walks
    ``torch.randperm(n)`` seeded by ``seed * 1_000_003 + k``; a batch may span two passes. The cursor alone
    decides, so a resumed run takes the rows an uninterrupted one would."""
    out: list[int] = []
    while len(out) < batch_size:
        epoch, offset = divmod(cursor, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        take = perm[offset: offset + batch_size - len(out)]
        out.extend(take)
        cursor += len(take)
    return out


def optimizer_settings(cfg: RunConfig) -> OptimizerSettings:
    """AdamW and schedule of ``optim.*`` over ``steps`` optimiser steps (one per step)."""
    o = cfg.optim
    return OptimizerSettings(lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, warmup_steps=o.warmup_steps,
                             total_steps=max(cfg.steps, 1), lr_schedule=o.schedule, max_grad_norm=o.max_grad_norm)


def step_trainer(cfg: RunConfig, model: torch.nn.Module) -> Trainer:
    """The learners' :class:`~posttrain.learner.trainer.Trainer` of ``model``'s parameters: one optimiser step
    per run step (:func:`optimizer_settings`), micro-batches of ``optim.microbatch_tokens``, shuffled under
    ``seed``."""
    return Trainer(list(model.parameters()), optimizer_settings(cfg),
                   BatchingSettings(microbatch_tokens=cfg.optim.microbatch_tokens, seed=cfg.seed))


def save_run_checkpoint(run_dir: Path, parts: RunParts, step: int, extra: Mapping[str, object]) -> Path:
    """Write ``run_dir/checkpoints/step_N`` (atomic; :func:`~posttrain.learner.checkpoint.save_checkpoint`):
    ``parts.model`` as ``actor/`` with ``parts.tokenizer``, ``parts.trainer``'s state under
    ``learner_state[parts.state_key]``, the RNG states and ``extra``; its path."""
    from posttrain.learner.checkpoint import checkpoint_path, save_checkpoint

    return save_checkpoint(checkpoint_path(run_dir, step), step=step, actor=parts.model, tokenizer=parts.tokenizer,
                           learner_state={parts.state_key: parts.trainer.state_dict()}, extra=extra)


def restore_run_checkpoint(run_dir: Path, parts: RunParts) -> tuple[int, dict[str, Any]]:
    """Load the newest checkpoint of ``run_dir`` that reads into ``parts.model`` / ``parts.trainer`` and the
    RNGs; ``(step, extra)``. An unreadable one falls back to the previous (a warning); none:
    :class:`~posttrain.loop.run_dir.RunDirError`."""
    from posttrain.learner.checkpoint import complete_checkpoints, load_checkpoint, restore_actor, restore_rng
    from posttrain.loop.run_dir import RunDirError

    for path in reversed(complete_checkpoints(run_dir / "checkpoints")):
        try:
            ck = load_checkpoint(path)
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("resume: checkpoint %s cannot be read (%s); trying the previous one", path, e)
            continue
        restore_actor(parts.model, ck)
        parts.trainer.load_state_dict(ck.learner_state[parts.state_key], owner=f"{parts.name} trainer")
        restore_rng(ck)
        return ck.step, ck.extra
    raise RunDirError(f"resume=true but no checkpoint of {run_dir / 'checkpoints'} can be read")


@contextmanager
def locked_run_dir(cfg: RunConfig) -> Iterator[Path]:
    """The run directory of ``cfg``, prepared and locked for the block (as the RL runs': a fresh run never
    writes into another run's history; ``resume=true`` checks the recipe against ``config.yaml``). A fresh
    directory is removed again when the block fails before ``config.yaml`` is written."""
    from posttrain.loop.checkpointing import check_resumable
    from posttrain.loop.run import run_dir_of
    from posttrain.loop.run_dir import RunDirLock, prepare_run_dir, refuse_to_overwrite

    fresh = not run_dir_of(cfg).exists()
    run_dir = prepare_run_dir(run_dir_of(cfg))
    lock = RunDirLock(run_dir)
    try:
        if cfg.resume:
            check_resumable(cfg, run_dir)
        else:
            refuse_to_overwrite(run_dir)
        yield run_dir
    except BaseException:
        if fresh and not (run_dir / "config.yaml").exists():  # a run that never started leaves no directory
            lock.release()
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        lock.release()


class RunLifecycle:
    """One run of a trainer program in its locked ``run_dir`` (module docstring). As a context manager:
    entering opens ``metrics.jsonl``, restores the latest checkpoint when ``cfg.resume`` and writes
    ``config.yaml``; leaving closes the metrics. ``after_save(path)``, when given, adds files to each
    checkpoint written (before the next step)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, parts: RunParts, *, curve: Curve,
                 after_save: Callable[[Path], None] | None = None) -> None:
        self.cfg, self.run_dir, self.parts, self.curve_spec, self.after_save = cfg, run_dir, parts, curve, after_save
        self.step, self.cursor, self.resumed = 0, 0, False
        self.curve: list[tuple[int, float]] = []
        self._before, self._start = 0.0, time.perf_counter()
        self.metrics: MetricsLog | None = None

    def wall_seconds(self) -> float:
        """Seconds of this run over all its tries (a resume adds to the checkpoint's)."""
        return self._before + time.perf_counter() - self._start

    def __enter__(self) -> RunLifecycle:
        from posttrain.loop.run_dir import write_text_atomic

        self.metrics = MetricsLog.for_run(self.run_dir, self.cfg)
        try:
            if self.cfg.resume:
                self._restore()
            write_text_atomic(self.run_dir / "config.yaml", dump_config(self.cfg))
        except BaseException:
            self.metrics.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def _restore(self) -> None:
        """Load the newest readable checkpoint into the parts and the RNGs; step, cursor, clock and curve."""
        self.step, extra = restore_run_checkpoint(self.run_dir, self.parts)
        self.cursor, self.resumed = int(extra["cursor"]), True
        self._before, self._start = float(extra["wall_seconds"]), time.perf_counter()
        self.curve = [(int(s), float(v)) for s, v in extra["curve"]]
        assert self.metrics is not None
        self.metrics.truncate_after(self.step)
        log.info("resumed %s at step %d", self.run_dir, self.step)

    def record(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """Write ``metrics`` of ``step`` to ``metrics.jsonl`` and the trackers."""
        assert self.metrics is not None, "record() outside the lifecycle's with-block"
        self.metrics.log(step, metrics)

    def evaluate(self, evaluate: Callable[[int], Mapping[str, float]]) -> None:
        """Run ``evaluate(step)`` now, record its metrics and append its curve metric to the curve."""
        ev = evaluate(self.step)
        self.curve.append((self.step, float(ev[self.curve_spec.key])))
        self.record(self.step, ev)

    def checkpoint(self) -> Path:
        """Write ``checkpoints/step_N`` of the current step (module docstring); its path."""
        path = save_run_checkpoint(self.run_dir, self.parts, self.step,
                                   {"trainer": self.parts.name, "cursor": self.cursor,
                                    "wall_seconds": self.wall_seconds(), "curve": self.curve})
        if self.after_save is not None:
            self.after_save(path)
        return path

    def run(self, step_fn: Callable[[int, int], StepOutput], evaluate: Callable[[int], Mapping[str, float]], *,
            progress: Progress | None = None) -> RunResult:
        """Steps ``self.step + 1 .. cfg.steps`` (module docstring); the result."""
        cfg = self.cfg
        if not self.resumed:
            self.evaluate(evaluate)
        label = self.parts.label
        bar = progress.add_task(label, total=cfg.steps, completed=self.step) if progress is not None else None
        while self.step < cfg.steps:
            raise_if_interrupted()  # a Ctrl-C a finalizer swallowed stops the run here, between steps
            t0 = time.perf_counter()
            out = step_fn(self.step, self.cursor)
            self.step, self.cursor = self.step + 1, out.cursor
            self.record(self.step, {**out.metrics, self.curve_spec.cursor_key: self.cursor,
                                    "step_seconds": time.perf_counter() - t0})
            if self.step % cfg.eval.every == 0 or self.step == cfg.steps:
                self.evaluate(evaluate)
            if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or self.step == cfg.steps:
                self.checkpoint()
            if progress is not None and bar is not None:
                loss = out.metrics.get("loss")
                progress.update(bar, completed=self.step,
                                description=label if loss is None else f"{label} loss {loss:.3f}")
        if self.step == 0:
            self.checkpoint()
        return RunResult(step=self.step, wall_seconds=self.wall_seconds(), curve_name=self.curve_spec.name,
                         curve=list(self.curve))


__all__ = ["Curve", "RunLifecycle", "RunParts", "RunResult", "Stateful", "StepOutput", "data_rows",
           "locked_run_dir", "optimizer_settings", "restore_run_checkpoint", "save_run_checkpoint", "step_trainer"]

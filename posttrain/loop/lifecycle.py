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

The trainers that sample their own data (RL in every ``system.mode``, online preference) have their own
outer driver (:mod:`posttrain.loop.sampling_lifecycle`: warm-up, producer, weight sync), built on the same
pieces of this module: the run directory's lock (:func:`open_run_dir`, :func:`check_resumable`), the resume
walk (:func:`restore_newest`), the clock (:class:`RunClock`), the evaluation and checkpoint schedule
(:func:`eval_due`, :func:`checkpoint_due`) and :class:`RunResult`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from posttrain.config import RunConfig, dump_config
from posttrain.learner.settings import BatchingSettings, OptimizerSettings
from posttrain.learner.trainer import Trainer
from posttrain.loop.interrupt import raise_if_interrupted
from posttrain.loop.metrics_log import MetricsLog

if TYPE_CHECKING:
    from rich.progress import Progress

    from posttrain.loop.run_dir import RunDirLock
    from posttrain.models.tokenizer_protocol import Tokenizer

log = logging.getLogger("posttrain")

T = TypeVar("T")


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
    RNGs (:func:`restore_newest`); ``(step, extra)``. None complete:
    :class:`~posttrain.loop.run_dir.RunDirError`."""
    from posttrain.learner.checkpoint import CheckpointState, load_checkpoint, restore_actor, restore_rng
    from posttrain.loop.run_dir import RunDirError

    ck: CheckpointState | None = restore_newest(run_dir, load_checkpoint)
    if ck is None:
        raise RunDirError(f"resume=true but no checkpoint of {run_dir / 'checkpoints'} can be read")
    restore_actor(parts.model, ck)
    parts.trainer.load_state_dict(ck.learner_state[parts.state_key], owner=f"{parts.name} trainer")
    restore_rng(ck)
    return ck.step, ck.extra


def restore_newest(run_dir: Path, restore: Callable[[Path], T], *,
                   fatal: tuple[type[BaseException], ...] = ()) -> T | None:
    """``restore(path)`` of the newest complete checkpoint of ``run_dir/checkpoints`` that loads, for every
    trainer's resume: one that raises (a truncated or corrupt file) is skipped with a warning and the previous
    one tried; an exception of ``fatal`` propagates. None when there is no complete checkpoint;
    :class:`~posttrain.loop.run_dir.RunDirError` naming the newest failure when none loads."""
    from posttrain.learner.checkpoint import complete_checkpoints
    from posttrain.loop.run_dir import RunDirError

    paths = complete_checkpoints(run_dir / "checkpoints")
    if not paths:
        return None
    first_err: str | None = None
    for path in reversed(paths):
        try:
            return restore(path)
        except fatal:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: fall back to the previous one
            why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            first_err = first_err or f"{path}: {why}"
            log.warning("resume: checkpoint %s cannot be loaded (%s); falling back to the previous one", path, why)
    raise RunDirError(f"resume: no checkpoint under {run_dir / 'checkpoints'} can be loaded ({first_err})")


def run_dir_of(cfg: RunConfig) -> Path:
    """The run directory of ``cfg``: ``run_dir``, default ``runs/<name>``."""
    return Path(cfg.run_dir or f"runs/{cfg.name}")


@dataclasses.dataclass
class OpenedRunDir:
    """A run directory prepared and locked for one run (:func:`open_run_dir`): its ``path``, its ``lock``,
    whether it was ``fresh`` (did not exist) and, for a forced resume, the recipe changes it accepted."""

    path: Path
    lock: RunDirLock
    fresh: bool
    forced: str | None

    def abandon(self) -> None:
        """Release the lock after a failure; a fresh directory whose run never started (no ``config.yaml``)
        is removed, so it leaves nothing behind."""
        self.lock.release()
        if self.fresh and not (self.path / "config.yaml").exists():
            shutil.rmtree(self.path, ignore_errors=True)

    def write_config(self, cfg: RunConfig, step: int) -> None:
        """Write ``config.yaml`` (atomic); a forced resume at ``step`` first keeps the old one as
        ``config.step_<N>.yaml`` (with a warning naming the changes)."""
        from posttrain.loop.run_dir import write_text_atomic

        if self.forced:
            keep = self.path / f"config.step_{step:06d}.yaml"
            os.replace(self.path / "config.yaml", keep)
            log.warning("resume_force: recipe changed (%s); the previous config is kept as %s", self.forced, keep)
        write_text_atomic(self.path / "config.yaml", dump_config(cfg))


def open_run_dir(cfg: RunConfig) -> OpenedRunDir:
    """The run directory of ``cfg``, prepared and locked, for every trainer: a fresh run never writes into
    another run's history (:func:`~posttrain.loop.run_dir.refuse_to_overwrite`); ``resume=true`` checks the
    recipe against ``config.yaml`` first (:func:`check_resumable`). On a refusal the lock is released and a
    fresh directory removed."""
    from posttrain.loop.run_dir import RunDirLock, prepare_run_dir, refuse_to_overwrite

    fresh = not run_dir_of(cfg).exists()
    path = prepare_run_dir(run_dir_of(cfg))
    opened = OpenedRunDir(path, RunDirLock(path), fresh, None)
    try:
        if cfg.resume:
            opened.forced = check_resumable(cfg, path)
        else:
            refuse_to_overwrite(path)
    except BaseException:
        opened.abandon()
        raise
    return opened


@contextmanager
def locked_run_dir(cfg: RunConfig) -> Iterator[Path]:
    """The run directory of ``cfg`` (:func:`open_run_dir`), locked for the block. A fresh directory is removed
    again when the block fails before ``config.yaml`` is written."""
    opened = open_run_dir(cfg)
    try:
        yield opened.path
    except BaseException:
        opened.abandon()
        raise
    finally:
        opened.lock.release()


def check_resumable(cfg: RunConfig, run_dir: Path) -> str | None:
    """Before building anything: refuse a ``resume=true`` that would start afresh or change the recipe.

    Raises ``RunDirError`` (a ``UserError``) when there is no complete checkpoint, or when the resolved
    config differs from the run's ``config.yaml`` outside :data:`~posttrain.loop.run_dir.RESUME_MAY_CHANGE`
    and ``resume_force`` is off (the message lists ``key: old -> new``), and so does another ``steps`` with
    a decaying learning-rate schedule (:func:`~posttrain.loop.run_dir.schedule_horizon_change`). Returns a
    one-line summary of the differences a forced resume accepts, else None.
    """
    from posttrain.learner.checkpoint import complete_checkpoints
    from posttrain.loop.run_dir import RunDirError, read_config_yaml, recipe_diff

    if not complete_checkpoints(run_dir / "checkpoints"):
        raise RunDirError(f"resume=true but {run_dir / 'checkpoints'} holds no complete checkpoint; "
                          "drop resume=true to start a new run there")
    old = read_config_yaml(run_dir / "config.yaml")
    if old is None:
        log.warning("resume: %s is missing or unreadable; the recipe cannot be compared", run_dir / "config.yaml")
        return None
    new = cfg.model_dump(mode="json")
    diff = recipe_diff(old, new)
    if diff and not cfg.resume_force:
        raise RunDirError(f"resume=true with a recipe that differs from {run_dir / 'config.yaml'}: "
                          f"{'; '.join(diff)} (set resume_force=true to resume anyway)")
    horizon = _horizon_change(cfg, run_dir, old, new)
    if horizon is not None:
        diff.append(horizon)
    return "; ".join(diff) if diff else None


def _horizon_change(cfg: RunConfig, run_dir: Path, old: Mapping[str, object], new: Mapping[str, object]) -> str | None:
    """:func:`check_resumable`'s schedule and placement checks: another ``steps`` under a decaying schedule is
    refused unless ``resume_force`` (then returned as an accepted change); placement-only changes are logged."""
    from posttrain.loop.run_dir import RunDirError, placement_changes, schedule_horizon_change

    horizon = schedule_horizon_change(old, new)
    if horizon is not None and not cfg.resume_force:
        raise RunDirError(f"resume=true with {horizon} ({run_dir / 'config.yaml'}): the learning rate decays over "
                          "steps, so the resumed steps would follow another curve than the steps already taken "
                          "(its rate changes at the resumed step); keep steps as recorded, or set "
                          "resume_force=true to decay over the new steps from there")
    moved = placement_changes(old, new)  # change no arithmetic: resumed as is, config.yaml gets the new values
    if moved:
        log.warning("resume: placement-only keys changed (%s); config.yaml records the new values", "; ".join(moved))
    return None if horizon is None else f"{horizon} (the learning rate decays over the new steps from the resumed step)"


def eval_due(cfg: RunConfig, step: int) -> bool:
    """Held-out evaluation after ``step``: every ``eval.every`` steps and at the last step."""
    return step % cfg.eval.every == 0 or step == cfg.steps


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    """A checkpoint after ``step``: every ``checkpoint_every`` steps (0: none between) and at the last step."""
    return bool(cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps


class RunClock:
    """The wall time of a run over all its tries: the earlier tries' seconds (restored from a checkpoint)
    plus this one's, counted from the last :meth:`restart`."""

    def __init__(self, before: float = 0.0) -> None:
        self.restart(before)

    def restart(self, before: float) -> None:
        """Count this try's time from now, on top of ``before`` seconds of earlier tries."""
        self._before, self._start = before, time.perf_counter()

    def seconds(self) -> float:
        """Seconds of the run so far, every try counted."""
        return self._before + time.perf_counter() - self._start


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
        self.clock = RunClock()
        self.metrics: MetricsLog | None = None

    def wall_seconds(self) -> float:
        """Seconds of this run over all its tries (a resume adds to the checkpoint's)."""
        return self.clock.seconds()

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
        self.clock.restart(float(extra["wall_seconds"]))
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
            if eval_due(cfg, self.step):
                self.evaluate(evaluate)
            if checkpoint_due(cfg, self.step):
                self.checkpoint()
            if progress is not None and bar is not None:
                loss = out.metrics.get("loss")
                progress.update(bar, completed=self.step,
                                description=label if loss is None else f"{label} loss {loss:.3f}")
        if self.step == 0:
            self.checkpoint()
        return RunResult(step=self.step, wall_seconds=self.wall_seconds(), curve_name=self.curve_spec.name,
                         curve=list(self.curve))


__all__ = ["Curve", "OpenedRunDir", "RunClock", "RunLifecycle", "RunParts", "RunResult", "Stateful", "StepOutput",
           "check_resumable", "checkpoint_due", "data_rows", "eval_due", "locked_run_dir", "open_run_dir",
           "optimizer_settings", "restore_newest", "restore_run_checkpoint", "run_dir_of", "save_run_checkpoint",
           "step_trainer"]

"""The run lifecycle of a trainer that samples its own data: RL (every ``system.mode``) and online preference.

A sampling trainer supplies a :class:`SamplingProgram`: the step function it trains with (built once the run
is open and warmed up) and the progress line it shows; :func:`run_sampling` does the rest, the same for
every such trainer::

    open (lock, build the parts, resume, config.yaml)         open_run: lifecycle.open_run_dir, the offline
    warm-up and the step-0 held-out evaluation (a fresh run)   trainers' lock / resume / clock
    producer of system.mode                                    producer.build_producer over the
                                                               run's SamplingSource
    for step in state.step + 1 .. steps:
        produced = producer.next_batch(step)                   rollout, validate, score, staleness filter
        metrics, stop = step_fn(run, producer, step, produced, t_step)   the trainer's: update, sync inside
                                                               producer.quiesce(), evaluate when due, guards,
                                                               ledger + metrics + checkpoint (run.finish_step)
        stop -> run.stop(reason) (checkpointed), end
    close the producer (its unconsumed samples counted) and the run (lock released)
    every verification failed -> NothingJudgedError, not "done"

A Ctrl-C a finalizer swallowed (:func:`~posttrain.loop.interrupt.raise_if_interrupted`) stops the run
between steps; any exception propagates after the producer and the run are closed, and the checkpoints
already written are untouched, so ``resume=true`` continues from the last one. The lock, the resume walk,
the clock, the evaluation / checkpoint schedule and :class:`~posttrain.loop.lifecycle.RunResult` are the
offline trainers' own (:mod:`posttrain.loop.lifecycle`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from posttrain.config import RunConfig
from posttrain.loop.checkpointing import RunState
from posttrain.loop.interrupt import raise_if_interrupted
from posttrain.loop.lifecycle import RunResult
from posttrain.loop.producer import Produced, Producer, build_producer
from posttrain.loop.run import Run, StepMetrics, open_run

if TYPE_CHECKING:
    import torch
    from rich.progress import Progress
    from transformers import PreTrainedTokenizerBase

    from posttrain.envs.prompt_render import PromptRenderer
    from posttrain.envs.task import Task, TaskExample
    from posttrain.learner.protocol import Learner
    from posttrain.rewards.scoring import VerifyBatch
    from posttrain.rollout.engine import RolloutEngine


class SamplingStep(Protocol):
    """One step of a sampling trainer: train on ``produced`` (the trajectories of ``step``, sampled since
    ``t_step``), sync the engine inside ``producer.quiesce()``, evaluate when due and record the step
    (:meth:`Run.finish_step <posttrain.loop.run.Run.finish_step>`); returns ``(metrics, stop_reason)``."""

    def __call__(self, run: Run, producer: Producer, step: int, produced: Produced,
                 t_step: float) -> tuple[StepMetrics, str | None]: ...


@dataclasses.dataclass(frozen=True)
class SamplingProgram:
    """What a sampling trainer supplies: its progress ``label``, ``prepare(run, fresh)`` (called once the run is
    open and, when ``fresh``, warmed up and evaluated at step 0; returns the step function) and
    ``describe(step, metrics, state)``, the progress line after a step."""

    label: str
    prepare: Callable[[Run, bool], SamplingStep]
    describe: Callable[[int, StepMetrics, RunState], str]


@dataclasses.dataclass(frozen=True)
class SamplingSource:
    """A training run as its rollout side reads it (:class:`~posttrain.loop.producer.TrainingRun`: the
    producers, the rollout driver and its players), given explicitly by :meth:`of`: the parts it samples,
    renders, scores and versions with, by name (``cfg``, ``engine``, ``learner``, ``task``, ``tokenizer``,
    ``renderer``, ``verify_batch``, ``plain_model``: the run's :class:`~posttrain.loop.parts.Parts`' own), and
    ``run``, whose data cursor draws the prompts (:meth:`next_prompts`) and whose ``state`` holds the rollout
    counters a checkpoint keeps."""

    cfg: RunConfig
    engine: RolloutEngine
    learner: Learner
    task: Task
    tokenizer: PreTrainedTokenizerBase
    renderer: PromptRenderer
    verify_batch: VerifyBatch
    plain_model: torch.nn.Module
    run: Run

    @classmethod
    def of(cls, run: Run) -> SamplingSource:
        """The source of ``run``: its parts' members and the run itself."""
        p = run.parts
        return cls(cfg=p.cfg, engine=p.engine, learner=p.learner, task=p.task, tokenizer=p.tokenizer,
                   renderer=p.renderer, verify_batch=p.verify_batch, plain_model=p.plain_model, run=run)

    @property
    def state(self) -> RunState:
        """The run's state (rollout counters ``rollout_calls`` / ``rollout_dropped``, read and advanced by the
        producer); read at each access, as a resume replaces it."""
        return self.run.state

    def next_prompts(self, n: int) -> list[TaskExample]:
        """The next ``n`` training prompts of the task at the run's data cursor
        (:meth:`Run.next_prompts <posttrain.loop.run.Run.next_prompts>`)."""
        return self.run.next_prompts(self.task, n)


def producer_inflight(producer: Producer) -> Callable[[], int]:
    """A callable counting the producer's samples in flight (queued, carried), for checkpoints."""
    def count() -> int:
        rollout = getattr(producer, "rollout", None)
        queue = getattr(producer, "queue", None)
        return (rollout.inflight() if rollout is not None else 0) + (queue.samples if queue is not None else 0)

    return count


def run_sampling(cfg: RunConfig, program: SamplingProgram, progress: Progress | None = None) -> RunState:
    """Run ``cfg.steps`` steps of ``program`` (module docstring); the run's final state (``unconsumed_samples``:
    samples generated but never trained on when it ended)."""
    run = open_run(cfg)  # locks run_dir, builds the parts, resumes if asked, writes config.yaml
    st = run.state
    try:
        fresh = st.step == 0
        if fresh:
            run.warmup_and_baseline(progress)  # SFT warm-up (if configured) and the step-0 held-out eval
        step_fn = program.prepare(run, fresh)
        bar = progress.add_task(program.label, total=cfg.steps, completed=st.step) if progress else None
        # after the warm-up: a worker thread samples from the warm weights
        producer = build_producer(cfg, SamplingSource.of(run))
    except BaseException:
        run.close()
        raise
    run.inflight_count = producer_inflight(producer)
    try:
        while st.step < cfg.steps:
            raise_if_interrupted()  # a Ctrl-C a finalizer swallowed stops the run here, between steps
            step, t_step = st.step + 1, time.perf_counter()
            produced = producer.next_batch(step)  # rollout + validate + score (+ staleness filter)
            metrics, stop_reason = step_fn(run, producer, step, produced, t_step)
            if progress is not None and bar is not None:
                progress.update(bar, completed=step, description=program.describe(step, metrics, st))
            if stop_reason:
                run.stop(stop_reason)
                break
    finally:
        try:
            st.unconsumed_samples = producer.close()
        finally:
            run.close()
    run.verdicts.check(str(run.dir / "ledger"))  # every verification failed: NothingJudgedError, not "done"
    return st


def heldout_result(state: RunState) -> RunResult:
    """A sampling run's :class:`~posttrain.loop.lifecycle.RunResult`: its steps, wall time, held-out accuracy
    curve and stop reason."""
    return RunResult(step=state.step, wall_seconds=state.wall_seconds, curve_name="held-out accuracy",
                     curve=[(s, a) for s, a, _ in state.heldout_curve], stopped=state.stopped)


__all__ = ["SamplingProgram", "SamplingSource", "SamplingStep", "heldout_result", "producer_inflight",
           "run_sampling"]

"""A model of the asynchronous speed-up: what overlapping rollout and learner can buy, from a measured step split.

Inputs, measured on a sync run (:class:`StepSplit`, one entry per step): the rollout side's time
``r_k`` (generation plus reward, on one rollout worker), the learner side's time ``l_k`` (log-probs,
update, bookkeeping) and the weight sync ``s_k``; optionally the group idle fraction ``i_k`` (the
share of sample-slots spent finished and waiting for the call's longest sample).

With ``N`` rollout workers a step's batch is split across them, so one call takes

    rho_k = r_k / N                    (sync, and async without streaming)
    rho_k = r_k * (1 - i_k) / N        (async with streaming: AReaL's continuous, interruptible
                                        generation keeps every slot busy, so no slot waits for a straggler)

Sync runs the two sides one after the other: ``T_sync = sum_k (r_k / N + l_k + s_k)``.

Asynchronous training with a staleness bound ``eta`` (``one_step_off``: eta = 1; ``async``:
``max_staleness``) is a two-stage pipeline with a bounded lead. Call ``c`` (the batch of step ``c``,
0-based) may start once the learner has made version ``c - eta``, i.e. finished step ``c - eta - 1``
(the admission rule of :class:`posttrain.loop.producer.ThreadedProducer`; Fu et al. 2025, AReaL,
arXiv:2505.24298, section 5). With ``P_c`` the time call ``c`` returns and ``C_k`` the time step ``k``
finishes (``P_{-1} = C_{-1} = 0``, ``C_j = 0`` for ``j < 0``):

    P_c = max(P_{c-1}, C_{c-eta-1}) + rho_c
    C_k = max(C_{k-1}, P_k) + l_k + s_k

and the predicted speed-up is ``T_sync / C_{K-1}`` over the ``K`` steps. ``eta = 0`` gives back
``T_sync`` exactly (speed-up 1). The steady-state bound, reached when the lead ``eta`` absorbs the
variation of ``rho_k``, is

    speedup <= (mean(r)/N + mean(l) + mean(s)) / max(mean(rho), mean(l) + mean(s))

which is at most 2 without streaming (both sides equal), and ``1 + 1 / (1 - i)`` with streaming at
balance (``mean(rho) = mean(l + s)``). Published figures for comparison: AReaL reports up to 2.77x
over synchronous systems on the same GPUs (Fu et al. 2025, arXiv:2505.24298), and veRL's fully
asynchronous policy trainer 2.35-2.67x on Qwen2.5-7B with 128 GPUs (veRL "Recipe: Fully Async Policy
Trainer", 2025); under this model those correspond to a long-tail idle fraction of 0.26-0.43 at
balance (:func:`idle_for_speedup`) — gains above 2x come from streaming away the long tail, not from
the overlap alone.

Assumptions: the rollout workers and the learner are separate devices (cores) in both schedules, so
sync leaves each idle while the other works; the weight sync is paid by the learner side; a call's
``N``-way split is ideal (no per-worker straggler). No interpreter lock: the model is what the rollout
in its own process can reach; threads sharing one GIL fall short of it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class StepSplit:
    """Per-step times of a run (seconds), one entry per step; ``idle_frac`` may be empty (no streaming gain).

    The model's input is a sync run's split. An overlapped run's split (:func:`split_from_metrics` of a
    one_step_off / async run) holds each side's own busy time instead, and ``wait_s`` the learner's waits for
    the rollout (empty for a sync run, whose learner never waits)."""

    rollout_s: tuple[float, ...]
    learner_s: tuple[float, ...]
    sync_s: tuple[float, ...]
    idle_frac: tuple[float, ...] = ()
    wait_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.rollout_s)
        if n == 0:
            raise ValueError("StepSplit: no steps")
        for name in ("learner_s", "sync_s") + (("idle_frac",) if self.idle_frac else ()) + (
                ("wait_s",) if self.wait_s else ()):
            if len(getattr(self, name)) != n:
                raise ValueError(f"StepSplit.{name}: {len(getattr(self, name))} entries for {n} steps")
        if min(self.rollout_s + self.learner_s + self.sync_s + self.wait_s) < 0:
            raise ValueError("StepSplit: negative time")
        if self.idle_frac and not all(0.0 <= x < 1.0 for x in self.idle_frac):
            raise ValueError("StepSplit.idle_frac: every entry must be in [0, 1)")

    @classmethod
    def uniform(cls, rollout_s: float, learner_s: float, sync_s: float = 0.0, steps: int = 1,
                idle_frac: float | None = None) -> StepSplit:
        """``steps`` identical steps."""
        return cls((rollout_s,) * steps, (learner_s,) * steps, (sync_s,) * steps,
                   () if idle_frac is None else (idle_frac,) * steps)


@dataclasses.dataclass(frozen=True)
class SpeedupPrediction:
    """The model's answer for one setting (times are per step, averaged over the simulated steps)."""

    workers: int
    max_staleness: int
    streaming: bool
    steps: int
    sync_step_s: float
    async_step_s: float
    speedup: float  # T_sync / T_async over ``steps`` steps
    bound: float  # steady-state bound (module docstring)


def _cycle(xs: Sequence[float], k: int) -> list[float]:
    return list(itertools.islice(itertools.cycle(xs), k))


def predict_speedup(split: StepSplit, *, workers: int = 1, max_staleness: int = 1, streaming: bool = False,
                    steps: int | None = None) -> SpeedupPrediction:
    """Predicted async/sync speed-up for ``workers`` rollout workers and staleness bound ``max_staleness``.

    The recurrence of the module docstring over ``steps`` steps (default: the measured ones; more
    cycle through the measured sequence). ``streaming`` needs ``split.idle_frac``. Pure: no clock,
    no randomness.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if streaming and not split.idle_frac:
        raise ValueError("streaming needs the measured idle fraction (StepSplit.idle_frac)")
    k = len(split.rollout_s) if steps is None else int(steps)
    if k < 1:
        raise ValueError(f"steps must be >= 1, got {k}")
    r, lrn, syn = _cycle(split.rollout_s, k), _cycle(split.learner_s, k), _cycle(split.sync_s, k)
    idle = _cycle(split.idle_frac, k) if streaming else [0.0] * k
    rho = [r[i] * (1.0 - idle[i]) / workers for i in range(k)]
    t_sync = sum(r[i] / workers + lrn[i] + syn[i] for i in range(k))
    p_prev = 0.0
    done: list[float] = []  # C_k
    for c in range(k):
        admit = done[c - max_staleness - 1] if c - max_staleness - 1 >= 0 else 0.0
        p_prev = max(p_prev, admit) + rho[c]
        done.append(max(done[-1] if done else 0.0, p_prev) + lrn[c] + syn[c])
    t_async = done[-1]
    mean_learn = (sum(lrn) + sum(syn)) / k
    bound = (t_sync / k) / max(sum(rho) / k, mean_learn) if max(sum(rho), mean_learn) > 0 else 1.0
    return SpeedupPrediction(workers=workers, max_staleness=max_staleness, streaming=streaming, steps=k,
                             sync_step_s=t_sync / k, async_step_s=t_async / k,
                             speedup=t_sync / t_async if t_async > 0 else 1.0, bound=bound)


def idle_for_speedup(speedup: float) -> float:
    """The long-tail idle fraction ``i`` at which a balanced streaming pipeline reaches ``speedup``:
    ``1 + 1 / (1 - i) = speedup`` (module docstring), for ``speedup`` in ``[2, inf)``."""
    if speedup < 2.0:
        raise ValueError(f"below 2x the overlap alone suffices (no idle needed), got {speedup}")
    return 1.0 - 1.0 / (speedup - 1.0)


def split_from_metrics(metrics: Sequence[dict[str, float]]) -> StepSplit:
    """The per-step split of a run's metrics (``metrics.jsonl`` rows / the ledger's).

    Rollout side = ``time/rollout_s + time/reward_s``; sync = ``time/weight_sync_s``; idle =
    ``rollout/group_idle_frac``. Learner side, for a sync run: the rest of ``time/step_s`` less ``time/eval_s``
    (log-probs, update, bookkeeping). A row with ``time/learner_wait_s`` comes from an overlapped mode, whose
    rollout call ran beside the learner: its learner side is ``time/step_s`` less ``time/eval_s``, the sync and
    the learner's waits (``time/learner_wait_s`` for the queue + ``time/quiesce_wait_s`` for the next call),
    and those waits go to ``wait_s``. Subtracting the concurrent rollout from the step instead would charge the
    learner's own time to the overlap."""
    roll, learn, syn, idle, wait = [], [], [], [], []
    overlapped = any("time/learner_wait_s" in m for m in metrics)
    for m in metrics:
        r = float(m.get("time/rollout_s", 0.0)) + float(m.get("time/reward_s", 0.0))
        s = float(m.get("time/weight_sync_s", 0.0))
        w = float(m.get("time/learner_wait_s", 0.0)) + float(m.get("time/quiesce_wait_s", 0.0))
        busy = float(m["time/step_s"]) - float(m.get("time/eval_s", 0.0)) - s
        rest = busy - w if overlapped else busy - r
        roll.append(r)
        syn.append(s)
        learn.append(max(0.0, rest))
        wait.append(w)
        idle.append(min(max(float(m.get("rollout/group_idle_frac", 0.0)), 0.0), 0.999))
    return StepSplit(tuple(roll), tuple(learn), tuple(syn), tuple(idle), tuple(wait) if overlapped else ())


__all__ = ["SpeedupPrediction", "StepSplit", "idle_for_speedup", "predict_speedup", "split_from_metrics"]

"""Held-out evaluation as a run does it: generate on held-out prompts, verify, report accuracy by status.

Accuracy is the fraction of held-out responses (greedy by default, one per prompt) the task's
verifier marks ``correct``; infra errors are excluded from the denominator and counted
(``heldout/infra_errors``). With ``samples = n > 1`` sampled responses per prompt, the result
also carries pass@k by the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374, eq. 1),
``pass@k = mean_prompts [1 - C(n_i - c_i, k) / C(n_i, k)]`` with ``n_i`` the prompt's samples
that are not infra errors and ``c_i`` its correct ones (see :func:`pass_at_k`). Single-turn
evaluation plays and judges through the rollout's one single-turn path
(:func:`~posttrain.loop.single_turn.play_once`), multi-turn evaluation plays whole episodes with
the rollout's episode player (:func:`evaluate_episodes`); verification goes through the same
guarded path as training (``verify_batch``, a :class:`~posttrain.rewards.VerifierPool`): a
verifier that raises, hangs or returns garbage on a held-out sample is an infra error there too,
never a crash or a freeze. The trainer (:meth:`Run.evaluate_and_judge
<posttrain.loop.run.Run.evaluate_and_judge>`, over the run's :class:`~posttrain.loop.parts.Parts`) and
``posttrain eval`` (:mod:`posttrain.evaluation.heldout`) both call :func:`heldout_metrics`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from posttrain.diagnostics.heldout_outcomes import SetOutcomes, append_outcomes
from posttrain.loop.episode_rollout import EpisodeRollout, context_limit, run_episodes, turn_seed
from posttrain.loop.heldout_breakdown import constraint_rates, has_tools, tool_calls_per_episode
from posttrain.loop.single_turn import Played, Renderer, Sampler, play_once
from posttrain.rewards.scoring import HasVerifier, VerifyBatch
from posttrain.rewards.verifier import Verifier
from posttrain.trajectory import Status
from posttrain.trajectory.record import JSONScalar

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.envs.task import Task, TaskExample
    from posttrain.models.tokenizer_protocol import Tokenizer
    from posttrain.rollout.engine import RolloutEngine


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, arXiv:2107.03374).

    The probability that at least one of ``k`` samples drawn without replacement from the ``n``
    generated ones (``c`` of them correct) is correct. ``1.0`` when ``n - c < k`` (every k-subset
    holds a correct one). Needs ``0 <= c <= n`` and ``1 <= k <= n``, else ``ValueError``.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Held-out figures of one policy revision."""

    accuracy: float
    reward_mean: float
    mean_length: float
    status_counts: dict[str, int]
    n: int
    # Per prompt: (samples that are not infra errors, correct ones); k of pass@k (1 = pass@1 only).
    per_prompt: tuple[tuple[int, int], ...] = ()
    k: int = 1
    # eval.hidden_verifier over the same responses (posttrain.rewards.hidden.heldout_metrics); {} without one.
    hidden: dict[str, float] = dataclasses.field(default_factory=dict)
    # Instruction following: {"ifc/<family>": share of that family's constraints met} (heldout_breakdown).
    constraint_rates: dict[str, float] = dataclasses.field(default_factory=dict)
    # Tool environments: mean tool calls per judged episode; None without tools (heldout_breakdown).
    tool_calls_mean: float | None = None

    @property
    def infra_errors(self) -> int:
        """Samples whose verification failed (excluded from the accuracy denominator)."""
        return int(self.status_counts.get(Status.INFRA_ERROR.value, 0))

    def as_metrics(self, prefix: str = "heldout") -> dict[str, float]:
        """Flat metric dict (``heldout/accuracy``, ``heldout/infra_errors`` ...; ``heldout/ifc/<family>``
        for instruction following, ``heldout/tool_calls_mean`` for a tool environment with its tools on)."""
        out = {f"{prefix}/accuracy": self.accuracy, f"{prefix}/reward_mean": self.reward_mean,
               f"{prefix}/mean_length": self.mean_length, f"{prefix}/infra_errors": float(self.infra_errors)}
        out.update({f"{prefix}/status/{k}": float(v) for k, v in self.status_counts.items()})
        out.update({f"{prefix}/hidden/{k}": v for k, v in self.hidden.items()})
        out.update({f"{prefix}/{k}": v for k, v in self.constraint_rates.items()})
        if self.tool_calls_mean is not None:
            out[f"{prefix}/tool_calls_mean"] = self.tool_calls_mean
        return out

    def passk_metrics(self, prefix: str = "heldout") -> dict[str, float]:
        """``{prefix}/pass@{k}`` and ``{prefix}/pass@1``: means over prompts of :func:`pass_at_k`.

        A prompt with fewer than ``k`` non-infra samples has no unbiased pass@k: it is left out of
        that mean and counted (``{prefix}/pass@{k}_prompts_skipped``); pass@1 skips only prompts
        with no valid sample. NaN when no prompt qualifies.
        """
        def mean_over(k: int) -> tuple[float, int]:
            vals = [pass_at_k(n, c, k) for n, c in self.per_prompt if n >= k]
            return (sum(vals) / len(vals) if vals else float("nan")), len(self.per_prompt) - len(vals)

        p1, _ = mean_over(1)
        pk, skipped = mean_over(self.k)
        return {f"{prefix}/pass@1": p1, f"{prefix}/pass@{self.k}": pk,
                f"{prefix}/pass@{self.k}_prompts_skipped": float(skipped),
                f"{prefix}/pass@{self.k}_samples": float(max((n for n, _ in self.per_prompt), default=0))}


def evaluate(
    engine: Sampler,
    tokenizer: Tokenizer,
    task: HasVerifier,
    examples: Sequence[TaskExample],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    verify_batch: VerifyBatch | None = None,
    samples: int = 1,
    k: int = 1,
    renderer: Renderer | None = None,
    hidden_verifier: Verifier | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> EvalResult:
    """Evaluate the engine's current weights on ``examples`` (``TaskExample`` objects).

    ``samples`` responses are drawn per prompt (``SamplingParams.n``; > 1 only makes sense with
    ``temperature > 0``), with the sampler's truncation ``top_k`` / ``top_p`` (0 / 1.0: none),
    and ``k <= samples`` is the k of :meth:`EvalResult.passk_metrics`;
    accuracy, reward and length are then means over all responses.
    ``verify_batch`` is the run's guarded verification (``VerifierPool.verify_batch`` or reward
    workers); None verifies in-process through a ``VerifierPool(workers=0)`` (default time limit).
    Never raises for a verifier's failure nor for a request that failed in a distributed rollout
    backend (:func:`~posttrain.loop.single_turn.play_once`): such a sample is an ``infra_error``.
    ``hidden_verifier`` (``eval.hidden_verifier``) re-judges the same responses through ``verify_batch``;
    its figures go to :attr:`EvalResult.hidden` only (accuracy and the rest are the training verifier's).
    ``renderer`` (:class:`~posttrain.envs.prompt_render.PromptRenderer`, the run's) turns examples into
    prompt ids; default: raw text.
    """
    from posttrain.envs.prompt_render import PromptRenderer
    from posttrain.rewards import VerifierPool
    from posttrain.rollout.sampling import SamplingParams

    if not 1 <= k <= samples:
        raise ValueError(f"evaluate: need 1 <= k <= samples, got k={k}, samples={samples}")
    if verify_batch is None:
        verify_batch = VerifierPool(workers=0).verify_batch
    played = play_once(engine, examples, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                                        n=samples, seed=seed, top_k=top_k, top_p=top_p),
                       request_ids=[f"eval{i}-{ex.prompt_id}" for i, ex in enumerate(examples)],
                       renderer=renderer if renderer is not None else PromptRenderer(tokenizer),
                       verifier=task.verifier, tokenizer=tokenizer, verify_batch=verify_batch)
    hidden = ({} if hidden_verifier is None
              else hidden_figures(played, hidden_verifier, tokenizer=tokenizer, verify_batch=verify_batch))
    return eval_result(played, len(examples), k=k, hidden=hidden)


def hidden_figures(played: Played, hidden_verifier: Verifier, *, tokenizer: Tokenizer,
                   verify_batch: VerifyBatch) -> dict[str, float]:
    """``eval.hidden_verifier``'s figures over ``played``'s responses
    (:func:`posttrain.rewards.hidden.heldout_metrics`, paired with the training verdicts by position):
    every response re-judged through ``verify_batch`` in one batch; a sample whose request failed in the
    backend has no response and is left out of both sides."""
    from posttrain.rewards.hidden import heldout_metrics
    from posttrain.rewards.scoring import judge

    idx = [i for i, bad in enumerate(played.failed) if not bad]
    _, hv = judge([played.completions[i] for i in idx], [played.examples[i] for i in idx],
                  verifier=hidden_verifier, tokenizer=tokenizer, verify_batch=verify_batch)
    return heldout_metrics([played.verdicts[i].status for i in idx], [v.status for v in hv])


def eval_result(played: Played, n_examples: int, *, k: int, hidden: dict[str, float]) -> EvalResult:
    """The :class:`EvalResult` of ``played`` (samples of ``n_examples`` prompts; ``rows[i]`` the prompt of
    sample ``i``): accuracy = ``correct / (samples - infra_error)`` (NaN with none judged), ``reward_mean``
    the mean ``task`` component and the constraint rates over judged samples, ``mean_length`` the mean
    completion length over all samples, ``per_prompt`` (judged, correct) per prompt for pass@``k``."""
    statuses: Counter[str] = Counter()
    rewards: list[float] = []
    lengths: list[int] = []
    judged: list[Mapping[str, float]] = []
    n_valid, n_correct = [0] * n_examples, [0] * n_examples
    for row, c, v in zip(played.rows, played.completions, played.verdicts, strict=True):
        statuses[v.status.value] += 1
        lengths.append(len(c.token_ids))
        if v.status is not Status.INFRA_ERROR:  # an infra error says nothing about the policy: not in n
            n_valid[row] += 1
            n_correct[row] += v.status is Status.CORRECT
            rewards.append(float(v.components.get("task", 0.0)))
            judged.append(v.components)
    valid = sum(n for s, n in statuses.items() if s != Status.INFRA_ERROR.value)
    return EvalResult(
        accuracy=statuses[Status.CORRECT.value] / valid if valid else float("nan"),
        reward_mean=sum(rewards) / len(rewards) if rewards else float("nan"),
        mean_length=sum(lengths) / len(lengths) if lengths else 0.0,
        status_counts=dict(statuses),
        n=n_examples,
        per_prompt=tuple(zip(n_valid, n_correct, strict=True)),
        k=k,
        hidden=hidden,
        constraint_rates=constraint_rates(judged),
    )


class EvaluatedRun(Protocol):
    """What a held-out evaluation reads of a run: met by its :class:`~posttrain.loop.parts.Parts` (training)
    and :class:`HeldoutRun` (``posttrain eval`` of a checkpoint)."""

    @property
    def cfg(self) -> RunConfig: ...

    @property
    def engine(self) -> RolloutEngine: ...

    @property
    def tokenizer(self) -> Tokenizer: ...  # a Hugging Face or posttrain char tokenizer

    @property
    def task(self) -> Task: ...

    @property
    def heldout(self) -> list[TaskExample]: ...

    @property
    def renderer(self) -> Renderer: ...  # posttrain.envs.prompt_render renderer (chat template / raw text)

    @property
    def verify_batch(self) -> VerifyBatch | None: ...

    @property
    def hidden_verifier(self) -> Verifier | None: ...  # eval.hidden_verifier's verifier


def check_eval_budget(cfg: RunConfig, examples: Sequence[TaskExample], tokenizer: Tokenizer, *, max_context: int | None,
                      renderer: Renderer) -> None:
    """Raise ``ValueError`` starting ``eval.max_new_tokens=N:`` when a single-turn held-out prompt of ``examples``
    does not fit ``max_context`` positions with the held-out token budget ``eval.max_new_tokens``; None when it
    is unset, at most ``sampling.max_new_tokens`` (the run checks every prompt with that budget already),
    with ``env.name`` set (an episode caps each turn by ``env.max_tokens`` and the context) or without a
    known context. Without it the engine would cut each held-out response at the context, silently."""
    from posttrain.envs.task import check_prompts

    budget = cfg.eval.max_new_tokens
    if cfg.env.name is not None or budget is None or budget <= cfg.sampling.max_new_tokens or max_context is None:
        return
    try:
        check_prompts(examples, tokenizer, max_context=max_context, max_new_tokens=budget, renderer=renderer)
    except ValueError as e:
        raise ValueError(f"eval.max_new_tokens={budget}: {e}") from None


def eval_splits(task: object) -> tuple[str, ...]:
    """The held-out sets ``task`` declares in ``task.eval_splits``; :data:`~posttrain.envs.task.DEFAULT_EVAL_SPLITS`
    (``("heldout",)``) when it declares none.

    ``"heldout"`` (in-distribution: the set that promotes / rejects) comes first; each other set is
    ``"heldout_<name>"`` (e.g. ``heldout_unseen``: problems in a surface training never shows), named
    once, and its metrics are today's ``heldout`` keys with ``<set>`` in place of ``heldout``
    (``heldout_unseen/accuracy``, ``heldout_unseen_sampled/accuracy``). A name ending in ``_sampled`` or
    ``_notool`` would collide with those keys. Anything else is a ``ValueError`` naming the task.
    """
    from posttrain.envs.task import DEFAULT_EVAL_SPLITS

    splits = tuple(getattr(task, "eval_splits", DEFAULT_EVAL_SPLITS))
    ok = (bool(splits) and splits[0] == "heldout" and len(set(splits)) == len(splits)
          and all(isinstance(s, str) and s.startswith("heldout_") and s != "heldout_"
                  and not s.endswith(("_sampled", "_notool")) for s in splits[1:]))
    if not ok:
        raise ValueError(f"task {getattr(task, 'name', type(task).__name__)!r}: eval_splits {splits!r} must be "
                         "'heldout' followed by distinct 'heldout_<name>' sets (no name ending in _sampled or _notool)")
    return splits


_SPLIT_CACHE: OrderedDict[tuple[int, str, int, int], tuple[object, list[TaskExample]]] = OrderedDict()
_SPLIT_CACHE_SIZE = 8


def split_examples(run: EvaluatedRun, split: str) -> list[TaskExample]:
    """The examples of held-out set ``split``: ``run.heldout`` for ``"heldout"``, else
    ``run.task.examples(split, eval.size, seed)`` (seed: ``eval.heldout_seed``, else the run's), fetched once
    per (task, split, size, seed) and cached
    (the last few; an entry holds its task, so a task's ``id`` is never reused while it is cached)."""
    if split == "heldout":
        return run.heldout
    cfg = run.cfg
    seed = cfg.eval.heldout_seed_of(cfg.seed)
    key = (id(run.task), split, cfg.eval.size, seed)
    hit = _SPLIT_CACHE.get(key)
    if hit is None:
        hit = (run.task, list(run.task.examples(split, cfg.eval.size, seed=seed)))
        _SPLIT_CACHE[key] = hit
        while len(_SPLIT_CACHE) > _SPLIT_CACHE_SIZE:
            _SPLIT_CACHE.popitem(last=False)
    _SPLIT_CACHE.move_to_end(key)
    return hit[1]


def verifier_only(verify_batch: VerifyBatch | None) -> VerifyBatch | None:
    """The run's guarded verification without its learned-reward scorers (``reward.model`` / ``reward.judge``:
    :class:`~posttrain.rewards.learned.LearnedRewards`): held-out accuracy is the task verifier's, so a
    held-out response is not scored (nothing reports the score) and a scorer's outage cannot turn its verdict
    into ``infra_error``; the episodes' held-out evaluation and ``posttrain eval`` verify the same way."""
    from posttrain.rewards.learned import LearnedRewards

    return verify_batch.inner if isinstance(verify_batch, LearnedRewards) else verify_batch


def evaluate_run(run: EvaluatedRun, temperature: float | None = None, samples: int = 1,
                 env_overrides: dict[str, JSONScalar] | None = None,
                 examples: Sequence[TaskExample] | None = None) -> EvalResult:
    """A run's held-out evaluation of its engine's current weights: the one path of training and ``posttrain eval``.

    ``run`` is a training run's :class:`~posttrain.loop.parts.Parts` or a :class:`HeldoutRun` (the same
    attributes: ``cfg``, ``engine``, ``tokenizer``, ``task``, ``heldout``, ``renderer``, ``verify_batch``,
    ``hidden_verifier``, ``plain_model``). ``examples`` default to ``run.heldout`` (another held-out set:
    :func:`split_examples`). Single-turn (``env.name`` unset): :func:`evaluate` on
    them rendered by ``run.renderer`` (task.chat_template / task.system_prompt), judged by
    ``run.task``'s verifier alone (reward.extract applied by ``build_task``; no learned-reward scorer:
    :func:`verifier_only`), ``eval.max_new_tokens`` tokens
    (default ``sampling.max_new_tokens``), seed ``cfg.seed``. Multi-turn: one whole episode per held-out
    start and sample (:func:`evaluate_episodes`) under the run's ``env``
    settings, ``env_overrides`` (e.g. ``{"use_tools": False}``) building the environments.
    ``temperature`` defaults to ``eval.temperature``; ``samples`` > 1 draws that many responses per
    prompt for pass@``min(eval.k, samples)``. A sampled evaluation (``temperature`` > 0) draws from the
    run's sampler, its ``sampling.top_k`` / ``top_p`` truncation included, on both paths (the turn sampler
    of an episode carries them too); greedy decoding ignores them.
    """
    cfg = run.cfg
    e = cfg.eval
    temp = e.temperature if temperature is None else temperature
    exs = run.heldout if examples is None else examples
    if cfg.env.name is not None:  # multi-turn: whole held-out episodes
        from posttrain.loop.rollout_stage import RolloutStage

        ro = EpisodeRollout(cfg, run, RolloutStage.from_config(cfg))
        res: EvalResult = evaluate_episodes(ro, exs, temperature=temp, max_new_tokens=e.max_new_tokens,
                                            env_overrides=env_overrides, samples=samples, k=min(e.k, samples))
        return res
    if env_overrides:
        raise ValueError(f"evaluate_run: env_overrides {env_overrides} need a multi-turn run (env.name)")
    sampled = temp > 0  # the sampler's truncation; greedy decoding takes the argmax either way
    return evaluate(run.engine, run.tokenizer, run.task, exs,
                    max_new_tokens=e.max_new_tokens or cfg.sampling.max_new_tokens, temperature=temp, seed=cfg.seed,
                    verify_batch=verifier_only(run.verify_batch), samples=samples, k=min(e.k, samples),
                    renderer=run.renderer, hidden_verifier=run.hidden_verifier,
                    top_k=cfg.sampling.top_k if sampled else 0, top_p=cfg.sampling.top_p if sampled else 1.0)


@dataclasses.dataclass(frozen=True)
class HeldoutEvaluation:
    """One evaluation of every held-out set: the main result, the flat metrics, the per-problem outcomes."""

    main: EvalResult  # "heldout" at eval.temperature: promotes / rejects
    metrics: dict[str, float]
    outcomes: dict[str, SetOutcomes]  # by metric prefix: heldout, heldout_sampled, heldout_unseen, ...


def outcomes_of(res: EvalResult, examples: Sequence[TaskExample]) -> SetOutcomes:
    """Per-problem (judged, correct) samples of ``res``, an evaluation of ``examples`` (same order): one
    entry per distinct problem, a repeated one's samples summed (:meth:`SetOutcomes.per_problem`)."""
    return SetOutcomes(tuple(ex.prompt_id for ex in examples), tuple(v for v, _ in res.per_prompt),
                       tuple(c for _, c in res.per_prompt)).per_problem()


def _split_evaluation(run: EvaluatedRun, split: str) -> tuple[EvalResult, dict[str, float], dict[str, SetOutcomes]]:
    """``(main result, metrics, {metric prefix: outcomes})`` of held-out set ``split`` (see :func:`heldout_metrics`)."""
    cfg = run.cfg
    e = cfg.eval
    n = e.samples or 1
    exs = split_examples(run, split)
    # pass@k needs sampled responses: the main evaluation's when it samples, else the sampled one's.
    res = evaluate_run(run, samples=n if e.temperature > 0 else 1, examples=exs)
    results = {split: res}
    extra: dict[str, float] = res.passk_metrics(split) if n > 1 and e.temperature > 0 else {}
    if e.sampled_temperature is not None:
        sres = results[f"{split}_sampled"] = evaluate_run(run, e.sampled_temperature,
                                                          samples=n if e.temperature == 0 else 1, examples=exs)
        extra = {**sres.as_metrics(f"{split}_sampled"), **extra,
                 **(sres.passk_metrics(split) if n > 1 and e.temperature == 0 else {})}
    if cfg.env.name is not None and cfg.env.eval_without_tools:  # the no-tool baseline beside it
        nres = results[f"{split}_notool"] = evaluate_run(run, env_overrides={"use_tools": False}, examples=exs)
        extra.update(nres.as_metrics(f"{split}_notool"))
    return res, {**res.as_metrics(split), **extra}, {name: outcomes_of(r, exs) for name, r in results.items()}


def heldout_evaluation(run: EvaluatedRun) -> HeldoutEvaluation:
    """Every held-out set of the run's task (:func:`eval_splits`) evaluated as :func:`heldout_metrics` says."""
    main: EvalResult | None = None
    metrics: dict[str, float] = {}
    outcomes: dict[str, SetOutcomes] = {}
    for split in eval_splits(run.task):
        res, m, outs = _split_evaluation(run, split)
        main = res if main is None else main
        metrics.update(m)
        outcomes.update(outs)
    assert main is not None  # eval_splits is never empty
    return HeldoutEvaluation(main, metrics, outcomes)


def heldout_metrics(run: EvaluatedRun, *, step: int | None = None,
                    run_dir: Path | None = None) -> tuple[EvalResult, dict[str, float]]:
    """Every held-out figure a run logs at an evaluation: ``(main result, its metrics and the extras)``.

    The main result is the ``heldout`` set's at ``eval.temperature`` (greedy by default: it promotes /
    rejects). The metric dict holds its ``heldout/*`` keys plus, as configured: ``heldout_sampled/*`` at
    ``eval.sampled_temperature``; pass@k over ``eval.samples`` responses of whichever evaluation
    samples (``heldout/pass@k``, Chen et al. 2021); ``heldout_notool/*`` (``env.eval_without_tools``);
    the breakdowns of :mod:`posttrain.loop.heldout_breakdown` (``heldout/ifc/<family>`` for instruction
    following, ``heldout/tool_calls_mean`` for a tool environment).
    Each further held-out set the task declares (:func:`eval_splits`, e.g. ``heldout_unseen``) gets the
    same figures, ``heldout`` replaced by its name (``heldout_unseen/accuracy``,
    ``heldout_unseen_sampled/accuracy``, ``heldout_unseen/pass@k``). With ``run_dir`` and ``step``, the
    per-problem outcomes of every evaluation are appended to ``run_dir``'s
    :data:`~posttrain.diagnostics.heldout_outcomes.OUTCOMES_FILE` (bootstrap intervals after the run).
    Both :meth:`Run.evaluate_and_judge <posttrain.loop.run.Run.evaluate_and_judge>` and
    ``posttrain eval`` call it, so a checkpoint's evaluation reproduces the run's record.
    """
    if (step is None) != (run_dir is None):
        raise ValueError("heldout_metrics: give both step and run_dir (to record per-problem outcomes) or neither")
    ev = heldout_evaluation(run)
    if run_dir is not None and step is not None:
        append_outcomes(run_dir, step, ev.outcomes)
    return ev.main, ev.metrics


def evaluate_episodes(rollout: EpisodeRollout, examples: Sequence[TaskExample], *, temperature: float = 0.0,
                      max_new_tokens: int | None = None, env_overrides: dict[str, JSONScalar] | None = None,
                      samples: int = 1, k: int = 1) -> EvalResult:
    """Held-out evaluation on whole episodes: ``samples`` episodes per example (each with its own
    sampling stream) under the engine's current weights at ``temperature`` (0 = greedy).
    ``env_overrides`` (e.g. ``{"use_tools": False}``) build the environments. Returns an
    :class:`EvalResult` whose accuracy is the fraction of episodes
    (``env_failure`` and ``infra_error`` ones left out) that ended ``correct``, ``reward_mean`` the mean ``task`` component,
    ``mean_length`` the mean action tokens per episode, and ``per_prompt`` (valid, correct)
    episodes per example for pass@``k`` (unbiased estimator, Chen et al. 2021, arXiv:2107.03374).
    """
    if samples < 1 or k < 1 or k > samples:
        raise ValueError(f"evaluate_episodes: need 1 <= k <= samples, got k={k}, samples={samples}")
    run, cfg = rollout.run, rollout.cfg
    eps = [rollout.new_episode(ex, traj_id=f"eval{i}" if samples == 1 else f"eval{i}/{j}", group_id=f"eval{i}",
                               env_overrides=env_overrides)
           for i, ex in enumerate(examples) for j in range(samples)]
    params = rollout.sampling(temperature=temperature, max_new_tokens=max_new_tokens)
    run_episodes(run.engine, eps, params, context=context_limit(run), seed_of=lambda e: turn_seed(cfg.seed, "eval", e.traj_id, e.turns))
    trajs = [e.trajectory() for e in eps]
    statuses = Counter(t.status.value for t in trajs if t.status is not None)
    unusable = (Status.ENV_FAILURE, Status.INFRA_ERROR)
    ok = [t for t in trajs if t.status not in unusable]
    per_prompt = []
    for i in range(len(examples)):
        mine = trajs[i * samples:(i + 1) * samples]
        valid = [t for t in mine if t.status not in unusable]
        per_prompt.append((len(valid), sum(t.status is Status.CORRECT for t in valid)))
    return EvalResult(
        accuracy=sum(t.status is Status.CORRECT for t in ok) / len(ok) if ok else float("nan"),
        reward_mean=sum(float(t.reward.components.get("task", 0.0)) for t in ok) / len(ok) if ok else float("nan"),
        mean_length=sum(t.num_actions for t in trajs) / len(trajs) if trajs else 0.0,
        status_counts=dict(statuses), n=len(examples), per_prompt=tuple(per_prompt), k=k,
        tool_calls_mean=(tool_calls_per_episode([t.reward.components for t in ok])
                         if eps and has_tools(eps[0].env) else None),
    )

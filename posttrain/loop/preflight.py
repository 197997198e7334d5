"""Preflight: the config errors a run would otherwise meet only at step 1, found before anything is written.

``posttrain train`` calls :func:`preflight` after loading the config and before the run directory
exists. It builds the parts of one training step that need no model and runs them on a tiny fake
batch:

- the **task** (``task.name`` / ``task.kwargs`` / ``reward.extract`` / ``reward.functions``) and its
  verifier, which judges one training example's reference answer and an empty response: every
  ``reward.weights`` key must be a component of those verdicts (else the first step's scoring fails
  with "weighted component(s) ... missing from the verdict"), the DAPO overlong shaping must accept
  ``reward.overlong_max_len`` / ``overlong_cache_len``, and an SFT warm-up needs the example's
  reference answer (``meta['answer']``);
- the **batch**: ``optim.num_minibatches`` cannot exceed the rows of a step
  (``sampling.prompts_per_step x group_size``);
- the **targets** of one step: :func:`posttrain.loop.targets.build_targets` with the recipe's
  ``credit.estimator`` (built-in or plug-in) and ``credit.kwargs``, the KL placement
  (``credit.kl_in_reward`` with ``loss.kl_estimator`` / ``loss.kl_coef``), critic values, the ReMax
  baseline and multi-turn step records exactly as the loop passes them, on 2 groups of
  ``sampling.group_size`` fake rows; the advantages (and returns) must come back ``[B, T]`` and finite.

- on-policy **distillation** (``loss.distill``): the teacher exists (a run's checkpoint ``step_N`` stands
  for its ``actor/``) and its tokenizer equals the student's (:func:`check_distill`); the keys
  ``loss.distill.only`` leaves without effect are refused at load (config/dead_settings.py);

- an LLM judge (``reward.judge``) answers one request (:func:`check_judge`);

- a learned reward (``reward.model.path``) is a reward model, not a policy checkpoint, by its marker file
  or its architecture's head, read from its files only
  (:func:`~posttrain.rewards.learned.check_reward_model`);

- for multi-turn recipes (``env.name``; their reward parts are checked against the environment's
  declaration at config load) one **episode** is started with the run's tokenizer, so an
  ``env.max_tokens`` without room for a turn, or an SFT warm-up without demonstrations, fails now One environment
  is reset for the first training episode, so a setting its first observation refutes (an OpenEnv
  ``env.kwargs.observation_field`` the observation lacks) fails now, not as every episode's env_failure.

Each failure is a :class:`~posttrain.config.ConfigError`: one line naming the key(s). The task built
here is handed to the run (:func:`posttrain.loop.builders.keep_task`), so a file or Hugging Face
dataset is not loaded twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from posttrain.config import ConfigError, RunConfig

if TYPE_CHECKING:
    from posttrain.envs.task import Task
    from posttrain.trajectory import TrajectoryBatch

_GROUPS = 2  # fake prompts of the dry targets batch
_PROMPT_LEN = 2


def preflight(cfg: RunConfig) -> None:
    """Raise :class:`~posttrain.config.ConfigError` (one line naming the key) when ``cfg`` would fail at
    step 1 for a config reason; return None when the dry build of the step's parts passes.

    Needs no model, engine or run directory and writes nothing. The single-turn task it builds is kept
    for the run's own :func:`~posttrain.loop.builders.build_task` (same config: same task object).
    """
    if cfg.env.name is None:
        task = _build_task(cfg)
        check_scoring(cfg, task)
        from posttrain.loop.builders import keep_task

        keep_task(cfg, task)
    else:
        check_episodes(cfg)
    check_batch(cfg)
    check_distill(cfg)
    check_targets(cfg)
    check_judge(cfg)
    from posttrain.rewards.learned import check_reward_model

    check_reward_model(cfg.reward)


def check_judge(cfg: RunConfig) -> None:
    """``reward.judge``: one request to the judge (no retry, one deadline of ``reward.judge.timeout_s`` for
    the connect and the whole reply) must get a 2xx reply in time; else a one-line
    :class:`~posttrain.config.ConfigError` naming ``reward.judge.url`` (a run would write its directory and
    judge every sample ``infra_error``): refused / unknown host / cut is "no judge answers there ... start
    the judge server first"; an HTTP error status names the status and the URL's path to check; a server that accepted the connection but whose whole
    reply did not arrive within the deadline is "too slow", naming ``reward.judge.timeout_s`` to raise
    (refused too: each of the run's calls has that same deadline). What the judge answers is not checked."""
    j = cfg.reward.judge
    if j is None:
        return
    from posttrain.rewards.judge import LLMJudge

    judge = LLMJudge(j.url, model=j.model, prompt_template=j.prompt_template, parse=j.parse,
                     score_pattern=j.score_pattern, timeout_s=j.timeout_s, retries=0, max_tokens=j.max_tokens)
    kind, why = judge.probe()
    if kind == "slow":
        raise ConfigError(f"reward.judge.url={j.url}: the judge accepted the connection but sent no complete reply "
                          f"within reward.judge.timeout_s={j.timeout_s:g}; refused, since every call of the run has "
                          "that deadline and its rows would all be infra_error: raise reward.judge.timeout_s or "
                          "make the judge faster")
    if kind == "http_error":
        raise ConfigError(f"reward.judge.url={j.url}: a server answers there but refuses the judge's request "
                          f"({why}); check the URL's path (an OpenAI-compatible /v1/chat/completions) and "
                          "reward.judge.model")
    if kind != "answers":
        raise ConfigError(f"reward.judge.url={j.url}: no judge answers there ({why}); start the judge server "
                          "first (an OpenAI-compatible /v1/chat/completions on this machine)")


def check_distill(cfg: RunConfig) -> None:
    """``loss.distill``: the teacher is ``builtin:NAME`` or an existing model directory (a run's checkpoint
    ``RUN/checkpoints/step_N`` stands for its ``actor/``, as for ``posttrain eval``) whose tokenizer equals
    the student's (:func:`~posttrain.loop.builders.check_same_tokenizer`: vocabulary size, eos id, a probe
    text's ids; skipped for a model whose tokenizer cannot be had without loading it, e.g. a SmolLM2 not yet
    converted: the run checks it when it loads the teacher). The keys ``loss.distill.only`` leaves without
    effect are refused at load (:data:`posttrain.config.dead_settings.RULES`).
    Raises :class:`~posttrain.config.ConfigError` naming the key."""
    d = cfg.loss.distill
    if d is None:
        return
    from pathlib import Path

    from posttrain.config.paths import resolve_model_dir
    from posttrain.loop.builders import check_same_tokenizer, load_tokenizer

    teacher_path = d.teacher if d.teacher.startswith("builtin:") else str(resolve_model_dir(d.teacher))
    if not d.teacher.startswith("builtin:") and not Path(teacher_path).is_dir():
        raise ConfigError(f"loss.distill.teacher={d.teacher}: no such directory (give a run's checkpoint "
                          "RUN/checkpoints/step_N, its actor/ directory, a Hugging Face model directory or "
                          "builtin:NAME)")
    try:
        student, teacher = load_tokenizer(cfg.model.path), load_tokenizer(teacher_path)
    except (OSError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        if not (Path(teacher_path) / "config.json").is_file():
            raise ConfigError(f"loss.distill.teacher={d.teacher}: no config.json there (not a model directory: give "
                              "a run's checkpoint RUN/checkpoints/step_N, its actor/ directory or a Hugging Face "
                              "model directory)") from None
        raise ConfigError(f"loss.distill.teacher={d.teacher}: cannot read its tokenizer: {_one_line(e)}") from None
    if student is not None and teacher is not None:
        check_same_tokenizer(student, teacher, student_path=cfg.model.path, teacher_path=d.teacher)


def check_batch(cfg: RunConfig) -> None:
    """A step's batch holds at most ``sampling.prompts_per_step x group_size`` rows, and each of the
    ``optim.num_minibatches`` minibatches needs one (the actor's and the critic's update cut the batch
    into that many parts): more minibatches than rows fails at the first update. Raises
    :class:`~posttrain.config.ConfigError` naming the key."""
    s, n = cfg.sampling, cfg.optim.num_minibatches
    rows = s.prompts_per_step * s.group_size
    if n > rows:
        raise ConfigError(f"optim.num_minibatches={n}: a step's batch has at most {rows} rows (sampling."
                          f"prompts_per_step={s.prompts_per_step} x sampling.group_size={s.group_size}) and each "
                          "minibatch needs one")


def _build_task(cfg: RunConfig) -> Task:
    from posttrain.loop.builders import build_task

    try:
        task: Task = build_task(cfg)
    except KeyError as e:  # an unknown registry name: the registry's message lists the valid ones
        raise ConfigError(f"task.name: {e.args[0] if e.args else e}") from None
    except (ValueError, TypeError, ImportError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"task {cfg.task.name!r}: {_first_line(e)}") from None
    return task


def _one_line(e: BaseException, limit: int = 400) -> str:
    """The whole message of ``e`` on one line (a library's multi-line error is not cut mid-sentence), at most
    ``limit`` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def check_scoring(cfg: RunConfig, task: Task) -> None:
    """One training example of ``task`` through the run's scoring: its verifier judges the reference
    answer and an empty response (in-process, ``reward.timeout_s``); each verdict that is not an
    infra error must carry every ``reward.weights`` component; the overlong shaping is applied to
    1 and ``sampling.max_new_tokens`` action tokens; with ``sft.steps > 0`` the example must have a
    reference answer. Raises :class:`~posttrain.config.ConfigError` naming the key.

    A verifier that raises or times out on these probes cannot be judged here (the run counts such
    verdicts as infra errors): nothing is raised for it.
    """
    from posttrain.rewards import VerifierPool, compose
    from posttrain.rewards.scoring import ScoringSpec, _shaping_components, verify_context
    from posttrain.trajectory import Status

    spec = ScoringSpec.of(cfg.reward)
    try:
        shaping = _shaping_components(spec, [1, cfg.sampling.max_new_tokens])
    except ValueError as e:
        raise ConfigError(f"reward.overlong_max_len={cfg.reward.overlong_max_len}, reward.overlong_cache_len="
                          f"{cfg.reward.overlong_cache_len}: {_first_line(e)}") from None
    try:
        examples = list(task.examples("train", 1, seed=cfg.seed))
    except Exception as e:  # noqa: BLE001 - the task cannot hand out an example: say which, before the run
        raise ConfigError(f"task {cfg.task.name!r}: cannot draw a training example: {_first_line(e)}") from None
    if not examples:
        return
    ex = examples[0]
    if cfg.sft.steps > 0:
        from posttrain.loop.warmup import reference_answer

        try:
            reference_answer(task, ex)
        except ValueError as e:
            raise ConfigError(f"sft.steps={cfg.sft.steps}: {_first_line(e)} (set sft.steps=0)") from None
    answer = ex.meta.get("answer") if ex.meta else None
    responses = [str(answer if answer is not None else ex.reference), ""]
    pool = VerifierPool(workers=0, timeout_s=cfg.reward.timeout_s, retries=0)
    try:
        verdicts = pool.verify_batch([(task.verifier, r, ex.reference, verify_context(task.verifier, ex))
                                      for r in responses])
    finally:
        pool.close()
    for v, extra in zip(verdicts, shaping, strict=True):
        if v.status is Status.INFRA_ERROR:
            continue
        # reward.model / reward.judge add their components to every verdict during the run.
        comps = {**v.components, **extra, **{k: 0.0 for k in cfg.reward.learned_components()}}
        missing = sorted(k for k in cfg.reward.weights if k not in comps)
        if missing:
            raise ConfigError(
                f"reward.weights.{missing[0]}: the verdicts of task {cfg.task.name!r} carry no component "
                f"{missing[0]!r} (they have {sorted(comps)}); weight only those, or add a reward.functions "
                f"entry named {missing[0]!r}")
        try:
            compose(comps, cfg.reward.weights)
        except ValueError as e:
            raise ConfigError(f"reward.weights: {_first_line(e)}") from None


def _tokenizer_and_context(cfg: RunConfig) -> tuple[Any, int | None] | None:
    """The run's tokenizer and model context without building the model: a builtin char preset's, or a
    local Hugging Face directory's (``AutoTokenizer`` / ``AutoConfig``); None for other models."""
    path = cfg.model.path
    if path.startswith("builtin:"):
        if path.split(":", 1)[1].startswith("smollm2"):
            return None
        import inspect

        from posttrain.models import build_char_tokenizer, build_tiny_model

        ctx = inspect.signature(build_tiny_model).parameters["max_position_embeddings"].default
        return build_char_tokenizer(), int(ctx)
    from transformers import AutoConfig

    from posttrain.models.tokenizer import load_pretrained_tokenizer

    return load_pretrained_tokenizer(path), getattr(AutoConfig.from_pretrained(path), "max_position_embeddings",
                                                        None)


def check_episodes(cfg: RunConfig) -> None:
    """Multi-turn (``env.name``): one training episode of the environment is started as the rollout
    starts it (``env.*`` settings, chat template, tool prompt) with the run's tokenizer, so an
    ``env.max_tokens`` that leaves no room for a first turn fails now; with ``sft.steps > 0`` the
    environment's demonstration is played through it (:func:`~posttrain.loop.episode_rollout.sft_pairs`).
    Before that, for any model, the first training episode's environment is reset once and its first
    observation rendered (:func:`_check_first_observation`): a setting that only a real observation can
    refute (the OpenEnv adapter's ``env.kwargs.observation_field``) is refused now, not met as every
    episode's env_failure at step 1. The tokenizer part is skipped for a model whose tokenizer cannot be
    had without loading it (``builtin:smollm2-*``). Raises :class:`~posttrain.config.ConfigError` naming
    the key."""
    import types

    from posttrain.loop.builders import build_task
    from posttrain.loop.episode_rollout import EpisodeRollout, sft_pairs

    try:
        task = build_task(cfg)
        ex = task.examples("train", 1, seed=cfg.seed)[0]
    except Exception as e:  # noqa: BLE001 - the environment cannot hand out an episode: say so before the run
        line = _first_line(e)
        if not line.startswith(f"env.name={cfg.env.name}:"):  # (an EnvTask refusal names it already)
            line = f"env.name={cfg.env.name}: cannot start an episode: {line}"
        raise ConfigError(line) from None
    _check_first_observation(cfg, task, ex)
    tc = _tokenizer_and_context(cfg)
    if tc is None:
        return
    tok, ctx = tc
    run = types.SimpleNamespace(task=task, tokenizer=tok, state=None,
                                plain_model=types.SimpleNamespace(config=types.SimpleNamespace(
                                    max_position_embeddings=ctx)))
    rollout = EpisodeRollout(cfg, run, None)
    try:
        rollout.new_episode(ex, traj_id="preflight", group_id="preflight")
        if cfg.sft.steps > 0:
            sft_pairs(rollout, [ex])
    except ValueError as e:
        raise ConfigError(_first_line(e)) from None


def _check_first_observation(cfg: RunConfig, task: Any, ex: Any) -> None:
    """Reset a fresh environment of ``task`` with the seed of episode ``ex``, as the rollout does; a
    :class:`~posttrain.config.ConfigError` it raises (a setting refuted by the real observation) is
    refused naming ``env.name``. Other reset failures are left to the run, which counts them as
    env_failure."""
    from posttrain.loop.episode_rollout import env_seed

    seed = env_seed(ex)
    try:
        task.make_env().reset(seed)
    except ConfigError as e:
        raise ConfigError(f"env.name={cfg.env.name}: the first observation (reset(seed={seed})) refutes a "
                          f"setting: {_first_line(e)}") from None
    except Exception:  # noqa: BLE001 - not a config error: the run records it as the episode's env_failure
        pass


def fake_batch(cfg: RunConfig) -> TrajectoryBatch:
    """A collated :class:`~posttrain.trajectory.TrajectoryBatch` of 2 groups of ``sampling.group_size``
    rows shaped like a step's: 2 prompt tokens, 2-3 action tokens, rewards 1 / 0 alternating within a
    group, the last row truncated, and the one-step record multi-turn episodes carry (``steps``)."""
    from posttrain.trajectory import Finish, Reward, Status, collate
    from posttrain.trajectory.record import StepRecord, make_trajectory

    trajs = []
    g_size = cfg.sampling.group_size
    for g in range(_GROUPS):
        for j in range(g_size):
            i = g * g_size + j
            n_act = 2 + (j % 2)
            r = 1.0 if (j + g) % 2 == 0 else 0.0
            last = g == _GROUPS - 1 and j == g_size - 1
            trajs.append(make_trajectory(
                traj_id=f"preflight-{i}", prompt_id=f"p{g}", group_id=f"g{g}",
                prompt_ids=[1] * _PROMPT_LEN, action_ids=[2] * n_act, action_logprobs=[-0.5] * n_act,
                action_versions=0, finish=Finish.TRUNCATED if last else Finish.TERMINAL,
                status=Status.CORRECT if r else Status.WRONG,
                reward=Reward(components={"task": r}, weights={"task": 1.0}, total=r),
                steps=StepRecord(anchors=(g,), rewards=(r,), action_tokens=(n_act,)),
            ))
    return collate(trajs, pad_token_id=0)


def check_targets(cfg: RunConfig) -> None:
    """Build one step's advantages (and returns) on :func:`fake_batch` exactly as the loop does
    (:func:`posttrain.loop.targets.build_targets`, same estimator, kwargs, KL placement, critic values
    and ReMax baseline) and check they are ``[B, T]`` and finite on action tokens.

    Raises :class:`~posttrain.config.ConfigError` naming ``credit.estimator`` and the reason (e.g.
    ``credit.kl_in_reward`` with a sequence-level estimator, or a plug-in estimator that fails on
    the inputs the loop gives it).
    """
    import posttrain.algos as A
    from posttrain.loop.targets import build_targets

    batch = fake_batch(cfg)
    b, t = batch.action_mask.shape
    mask = batch.action_mask.to(torch.float64)
    old = -0.5 * mask
    ref = (old - 0.1) * mask if cfg.loss.kl_estimator is not None else None
    distill = cfg.loss.distill
    critic = cfg.critic.enabled
    needs = A.ADVANTAGES.needs(cfg.credit.estimator)
    est = cfg.credit.estimator
    where = f"credit.estimator={est}" + (f" with credit.kl_in_reward=true (loss.kl_estimator="
                                         f"{cfg.loss.kl_estimator})" if cfg.credit.kl_in_reward else "")
    try:
        tg = build_targets(
            batch, old_logprob=old, ref_logprob=ref,
            values=torch.zeros(b, t, dtype=torch.float64) if critic else None,
            final_values=torch.zeros(b, dtype=torch.float64) if critic else None,
            estimator=est, estimator_kwargs=cfg.credit.kwargs, kl_in_reward=cfg.credit.kl_in_reward,
            kl_estimator=cfg.loss.kl_estimator, kl_coef=float(cfg.loss.kl_coef),
            baseline=torch.full((b,), 0.5, dtype=torch.float64) if "baseline" in needs else None,
            teacher_logprob=(old - 0.2) * mask if distill is not None else None,
            distill_coef=None if distill is None else distill.coef, distill_only=distill is not None and distill.only,
        )
    except Exception as e:  # noqa: BLE001 - whatever step 1 would raise here is the recipe's error
        raise ConfigError(f"{where}: one step's advantages cannot be built: {type(e).__name__}: "
                          f"{_first_line(e)}") from None
    adv = tg.advantages
    if not isinstance(adv, torch.Tensor) or tuple(adv.shape) not in ((b, t), (b,)):
        shape = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
        raise ConfigError(f"{where}: the estimator returned advantages of shape {shape} for a batch of "
                          f"{(b, t)} (expected [B, T] or [B])")
    on_actions = adv if adv.dim() == 1 else adv[mask > 0]
    if not bool(torch.isfinite(on_actions).all()):
        raise ConfigError(f"{where}: the estimator returned non-finite advantages on a fake batch of "
                          f"{_GROUPS} groups x {cfg.sampling.group_size}")


__all__ = ["check_batch", "check_distill", "check_episodes", "check_judge", "check_scoring", "check_targets", "fake_batch",
           "preflight"]

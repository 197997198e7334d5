"""Multi-turn episodes as the rollout of a run (``env.name`` set): the episode player of the rollout driver.

:class:`EpisodeRollout` is the :class:`~posttrain.loop.rollout.Player` whose members are
episodes; the driver (:class:`~posttrain.loop.rollout.Rollout`) plans, suspends, resumes and
emits them exactly as it does single-turn samples, for the producers of every system mode.
One call = ``prompts_per_step`` groups of ``group_size`` episodes; every
episode of a group starts from the same environment seed (same task and initial state: the group
baseline of GRPO and GiGPO's anchor states compare like with like).

Turn rounds: each round gathers the next policy turn of *every* live episode into one engine
``generate`` call (one call per round, not one per episode), then steps each environment with
its turn's text (:class:`~posttrain.envs.multiturn.EpisodeState`: action tokens with the engine's
per-token log-probs and versions, observation tokens with ``action_mask = 0``). A turn the engine
returns ``paused`` (async mode with ``interrupt_on_update``: a weight update arrived) is resumed
in the same round under the new weights, so one trajectory's tokens can carry several behaviour
versions, across turns and within one. Episodes end by the environment (terminal), by
``env.max_turns`` / ``env.max_tokens`` / ``env.max_wall_s`` or a turn cut by
``sampling.max_new_tokens`` (truncated), or by an environment exception (``env_failure``: no
reward, counted, excluded from the update). With partial rollout (``system.partial_fraction`` < 1)
a call returns once enough episodes have ended and suspends the others between two turns, with
their environment state, until a later call resumes them (the driver's finish target).

Episodes score themselves (the environment's reward parts). A learned reward (``reward.model`` /
``reward.judge``: the run's verification is a :class:`~posttrain.rewards.learned.LearnedRewards`)
adds its component to each emitted episode the environment did not fail
(:func:`add_learned_components`): it scores ``(prompt, response)`` = the example's prompt (the first
observation) and the episode after it as the policy saw it (its turns and the observations between
them, :func:`episode_response`); a row it cannot score becomes ``infra_error`` (no reward, never a zero).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from posttrain.config import RunConfig
from posttrain.config.engines import engine_entry
from posttrain.envs.multiturn import EpisodeState
from posttrain.loop.backends.base import generate_detailed
from posttrain.loop.rollout import Advanced, Group
from posttrain.rewards.compose import compose
from posttrain.rewards.learned import ComponentScorer, LearnedRewards, add_component
from posttrain.rewards.verdict import Verdict
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import Completion, GenerationRequest
from posttrain.trajectory import Finish, Reward, Role, Status, Trajectory
from posttrain.trajectory.record import JSONScalar

if TYPE_CHECKING:
    from posttrain.envs.task import TaskExample
    from posttrain.models.tokenizer_protocol import Tokenizer


def turn_seed(*parts: object) -> int:
    """A sampling seed from the run seed and an episode turn's coordinates (stable across processes)."""
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:4], "big") >> 1


def env_seed(example: TaskExample) -> int:
    """The environment seed of an environment task's example (``meta["env_seed"]``)."""
    seed = example.meta.get("env_seed")
    if seed is None or isinstance(seed, bool):
        raise ValueError(f"example {example.prompt_id!r}: meta['env_seed'] must be an integer, got {seed!r}")
    return int(seed)


def engine_context(cfg: RunConfig | None, model: object) -> int | None:
    """Positions a prompt and its response may fill: ``model``'s ``max_position_embeddings``, capped by
    the engine entry's ``context_cap`` (``rollout.vllm.max_model_len`` with ``rollout.engine=vllm`` (vLLM stops a sample there without an
    error, and refuses a longer prompt)); None when neither is known."""
    ctx: int | None = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    cap = engine_entry(cfg.rollout.engine).context_cap(cfg.rollout) if cfg is not None else None
    if cap is None:
        return ctx
    return cap if ctx is None else min(ctx, cap)


def context_limit(run: object) -> int | None:
    """The run's context for its engine (:func:`engine_context` of ``run.cfg`` and ``run.plain_model``)."""
    return engine_context(getattr(run, "cfg", None), getattr(run, "plain_model", None))


def generate_turns(engine: RolloutEngine, requests: Sequence[GenerationRequest]
                   ) -> tuple[dict[str, Completion], int, dict[str, str]]:
    """One turn per request: ``({request_id: finished completion}, engine calls, {request_id: reason})``.

    A completion returned ``paused`` (a weight update interrupted the call) is resumed with
    ``GenerationRequest(resume=...)`` until it finishes; its later tokens carry the newer version.
    A request a worker set could not serve (dead worker, timeouts; :func:`generate_detailed`) is
    returned with its reason: its episode becomes ``infra_error``, never a zero reward.
    """

    done: dict[str, Completion] = {}
    failed: dict[str, str] = {}
    pending = list(requests)
    params_of = {r.request_id: r.params for r in requests}
    calls = 0
    while pending:
        comps, fails = generate_detailed(engine, pending)
        calls += 1
        failed.update({f.request.request_id: f.reason for f in fails})
        pending = []
        for c in comps:
            if c.finished:
                done[c.request_id] = c
            else:
                params = c.params if c.params is not None else params_of[c.request_id]
                pending.append(GenerationRequest(request_id=c.request_id, prompt_ids=list(c.prompt_ids),
                                                 params=params, resume=c))
    return done, calls, failed


def run_episodes(engine: RolloutEngine, episodes: Sequence[EpisodeState], params: SamplingParams, *,
                 seed_of: Callable[[EpisodeState], int],
                 context: int | None = None, finish_target: int | None = None) -> dict[str, float]:
    """Advance ``episodes`` (already started) in turn rounds; returns round metrics.

    ``params``: the sampler (``n`` is forced to 1; ``max_new_tokens`` is capped per episode by its
    token budget and the model's ``context``); ``seed_of(episode) -> int`` seeds its next turn.
    Without ``finish_target`` every episode runs to its end. With it (partial rollout) the rounds
    stop after the first round at whose end at least ``finish_target`` of the episodes that were
    live on entry have ended; the others stay live, between two turns, with their environments.
    """

    rounds = engine_calls = 0
    new_tokens = 0
    live_on_entry = [e for e in episodes if not e.done]
    while True:
        if finish_target is not None and sum(e.done for e in live_on_entry) >= finish_target:
            break
        live = [e for e in episodes if e.wants_action()]
        if context is not None:
            for e in live:
                if len(e.ids) >= context - 1:  # no room for a single new token: a limit like max_tokens
                    e.truncate(f"model context {context} reached")
            live = [e for e in live if not e.done]
        if not live:
            break
        reqs = []
        for e in live:
            cap = e.tokens_left() if context is None else min(e.tokens_left(), context - 1 - len(e.ids))
            reqs.append(GenerationRequest(
                request_id=f"{e.traj_id}@t{e.turns}", prompt_ids=e.context(),
                params=dataclasses.replace(params, n=1, seed=seed_of(e), max_new_tokens=max(1, min(params.max_new_tokens, cap)))))
        done, calls, failed = generate_turns(engine, reqs)
        rounds += 1
        engine_calls += calls
        for e, r in zip(live, reqs, strict=True):
            if r.request_id in failed:
                e.infra_fail(failed[r.request_id])
                continue
            c = done[r.request_id]
            new_tokens += len(c.token_ids)
            e.apply(c.token_ids, c.logprobs, c.versions, "length" if c.finish_reason == "length" else "stop")
    return {"episode/turn_rounds": float(rounds), "episode/engine_calls": float(engine_calls),
            "rollout/new_tokens": float(new_tokens)}


class SamplingStage(Protocol):
    """What an episode rollout reads of its rollout stage: the sampler parameters (met by
    :class:`~posttrain.loop.rollout_stage.RolloutStage`, which builds episode rollouts: a structural type,
    so this module does not import it)."""

    @property
    def sampling(self) -> SamplingParams: ...


class EpisodeRollout:
    """The multi-turn :class:`~posttrain.loop.rollout.Player` (see the module docstring).

    A fresh group is ``group_size`` episodes of its example, started from the same environment
    seed; a call advances the resumed, then the fresh episodes in turn rounds until the driver's
    finish target of them have ended (:func:`run_episodes`). A suspended episode waits between two
    turns with its environment, transcript, per-token log-probs and versions (the wait does not
    count against ``env.max_wall_s``). Episodes score themselves (the environment's reward parts).
    """

    def __init__(self, cfg: RunConfig, run: Any, stage: SamplingStage | None) -> None:
        self.cfg, self.run, self.stage = cfg, run, stage

    def new_episode(self, ex: TaskExample, *, traj_id: str, group_id: str,
                    env_overrides: Mapping[str, JSONScalar] | None = None) -> EpisodeState:
        """A started episode of example ``ex`` (``meta["env_seed"]``) under the run's ``env`` settings,
        weighting the environment's reward parts (``reward.weights`` less the learned components, which
        :meth:`emit` adds)."""
        e = self.cfg.env
        tok = self.run.tokenizer
        learned = self.cfg.reward.learned_components()
        ep = EpisodeState(
            self.run.task.make_env(**(env_overrides or {})), tok, seed=env_seed(ex), traj_id=traj_id,
            group_id=group_id, prompt_id=ex.prompt_id, max_turns=e.max_turns, max_tokens=e.max_tokens,
            max_wall_s=e.max_wall_s, weights={k: w for k, w in self.cfg.reward.weights.items() if k not in learned},
            use_chat_template=e.use_chat_template,
            system=e.system, tool_prompt=e.tool_prompt, fallback_prompt_ids=tok(ex.prompt).input_ids).start()
        room = min(e.max_tokens, (context_limit(self.run) or e.max_tokens + 1) - 1)
        if ep.status is not Status.ENV_FAILURE and len(ep.ids) >= room:
            # Every episode would end before its first turn: a silently useless run.
            raise ValueError(f"env.max_tokens={e.max_tokens} (model context {context_limit(self.run)}): the first "
                             f"observation of {ex.prompt_id!r} renders to {len(ep.ids)} tokens, no room for a turn")
        return ep

    def sampling(self, temperature: float | None = None, max_new_tokens: int | None = None) -> SamplingParams:
        """The per-turn sampler: the stage's, with ``env.stop_strings`` (and the given overrides)."""
        if self.stage is None:
            raise ValueError("EpisodeRollout built without a rollout stage has no sampler")
        p = self.stage.sampling
        return dataclasses.replace(
            p, stop_strings=tuple(self.cfg.env.stop_strings),
            temperature=p.temperature if temperature is None else temperature,
            max_new_tokens=p.max_new_tokens if max_new_tokens is None else max_new_tokens)

    # ------------------------------------------------------------------ the Player protocol
    def start(self, group: Group[EpisodeState], index: int, step: int, round_idx: int) -> list[EpisodeState]:
        """``group_size`` started episodes of the group's example (traj ids ``{group id}/{j}``)."""
        gid = group.group_id
        return [self.new_episode(group.example, traj_id=f"{gid}/{j}", group_id=gid)
                for j in range(self.cfg.sampling.group_size)]

    def versions(self, member: EpisodeState) -> list[int]:
        """The versions of the episode's action tokens so far."""
        return [v for v in member.vers if v >= 0]

    def ended(self, member: EpisodeState) -> bool:
        """Whether the episode has ended."""
        return bool(member.done)

    def resume(self, member: EpisodeState) -> None:
        """Restart the episode's wall-time clock (:meth:`EpisodeState.resume`)."""
        member.resume()

    def suspend(self, member: EpisodeState, call: int) -> None:
        """Stop the episode's wall-time clock between two turns (:meth:`EpisodeState.suspend`)."""
        member.suspend()

    def advance(self, resumed: list[EpisodeState], fresh: list[EpisodeState], finish_target: int | None,
                call: int) -> Advanced[EpisodeState]:
        """Turn rounds over the resumed, then the fresh episodes (:func:`run_episodes`)."""
        todo = resumed + fresh
        planned = sum(not e.done for e in todo)
        cfg = self.cfg
        info = run_episodes(self.run.engine, todo, self.sampling(), context=context_limit(self.run),
                            finish_target=finish_target, seed_of=lambda e: turn_seed(cfg.seed, e.traj_id, e.turns))
        info["rollout/rows"] = float(len(todo))
        return Advanced(todo, sum(e.done for e in todo) - (len(todo) - planned), info)

    def emit(self, groups: list[Group[EpisodeState]], call: int, step: int
             ) -> tuple[list[list[Trajectory]], dict[str, float]]:
        """The episodes' own records (scored by their environments) and ``episode/*`` metrics."""
        record = self.sampling().to_record()
        out = [[e.trajectory(sampling=record, meta={"rollout_call": call, "version_span": _span(e),
                                                    "pauses": e.pauses, "pause_age": call - g.call})
                for e in g.members] for g in groups]
        learned = getattr(self.run, "verify_batch", None)
        t0 = time.perf_counter()
        if isinstance(learned, LearnedRewards):
            tok = self.run.tokenizer
            flat = add_learned_components(
                [t for g in out for t in g], [str(g.example.prompt) for g in groups for _ in g.members],
                [episode_response(e, tok) for g in groups for e in g.members], learned.components,
                self.cfg.reward.weights)
            scored = iter(flat)
            out = [[next(scored) for _ in g] for g in out]
        return out, {**episode_metrics([t for g in out for t in g]), "time/reward_s": time.perf_counter() - t0}


def episode_response(episode: EpisodeState, tokenizer: Tokenizer) -> str:
    """The episode after its prompt as text: its policy turns and the observations between them, decoded
    as the policy saw them (special tokens such as chat role markers left out)."""
    start = next((i for i, r in enumerate(episode.roles) if r is not Role.PROMPT), len(episode.roles))
    return str(tokenizer.decode(episode.ids[start:], skip_special_tokens=True))


def add_learned_components(trajs: Sequence[Trajectory], prompts: Sequence[str], responses: Sequence[str],
                           scorers: Sequence[ComponentScorer], weights: Mapping[str, float]) -> list[Trajectory]:
    """``trajs`` (episodes scored by their environments) with each learned component of ``scorers`` added.

    Row ``i`` is scored on ``(prompts[i], responses[i])`` unless the episode is ``env_failure`` or
    ``infra_error`` (no reward to add to); its reward is then ``compose(environment parts + learned
    components, weights)`` (``weights``: the full ``reward.weights``). A row a scorer gives no value
    becomes ``infra_error`` (no reward total, the scorer's reason and the environment's status in the
    explanation): never a zero (:func:`~posttrain.rewards.learned.add_component`)."""
    skip = (Status.ENV_FAILURE, Status.INFRA_ERROR)
    rows = [i for i, t in enumerate(trajs) if t.status is not None and t.status not in skip]
    verdicts = [Verdict(t.status, dict(t.reward.components), str(t.meta.get("explanation", "")))
                for t in (trajs[i] for i in rows) if t.status is not None]
    for c in scorers:
        verdicts = add_component(verdicts, [prompts[i] for i in rows], [responses[i] for i in rows], c.name,
                                 c.score_rows)
    out = [dataclasses.replace(t, reward=Reward(components=dict(t.reward.components), weights=dict(weights), total=None))
           if t.status in skip else t for t in trajs]
    for i, v in zip(rows, verdicts, strict=True):
        t = trajs[i]
        if v.status is Status.INFRA_ERROR:
            out[i] = dataclasses.replace(t, status=Status.INFRA_ERROR, reward=Reward(components={}, weights=dict(weights),
                                         total=None), meta={**t.meta, "explanation": v.explanation[:500]})
        else:
            out[i] = dataclasses.replace(t, reward=compose(v.components, weights))
    return out


def _span(e: EpisodeState) -> int:
    v = [x for x in e.vers if x >= 0]
    return (max(v) - min(v)) if v else 0


def episode_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``episode/turns_mean``, ``episode/env_failures``, ``episode/truncated``, ``episode/tool_calls_mean``,
    ``episode/invalid_actions_mean`` and ``episode/obs_tokens_mean`` of a call's episodes."""
    n = max(len(trajs), 1)
    comps: Counter[str] = Counter()
    for t in trajs:
        comps.update({k: v for k, v in t.reward.components.items() if k in ("tool_calls", "invalid_actions")})
    return {
        "episode/turns_mean": sum(float(t.meta.get("turns", 0) or 0) for t in trajs) / n,
        "episode/env_failures": float(sum(t.status is Status.ENV_FAILURE for t in trajs)),
        "episode/truncated": float(sum(t.finish is Finish.TRUNCATED for t in trajs)),
        "episode/tool_calls_mean": comps["tool_calls"] / n,
        "episode/invalid_actions_mean": comps["invalid_actions"] / n,
        "episode/obs_tokens_mean": sum(int(sum(r.value == "observation" for r in t.roles)) for t in trajs) / n,
    }


def sft_demonstrations(rollout: EpisodeRollout, examples: Sequence[TaskExample]
                       ) -> list[list[tuple[list[int], list[int]]]]:
    """SFT warm-up data from the environment's demonstrations (``env.demonstration(seed) -> turns``), one list
    per example: its demonstration's pairs in turn order.

    Each demonstration is played through an episode exactly as the rollout renders it (same
    template, tool prompt and observations), and each of its assistant turns becomes one pair
    ``(all tokens before the turn, the turn's tokens + eos)`` (:func:`posttrain.learner.sft.run_sft`).
    The warm-up draws whole demonstrations (:func:`posttrain.loop.warmup.sft_warmup`), so a call and the
    answer that follows it are in the same step.
    """
    tok = rollout.run.tokenizer
    demos: list[list[tuple[list[int], list[int]]]] = []
    for i, ex in enumerate(examples):
        ep = rollout.new_episode(ex, traj_id=f"sft{i}", group_id=f"sft{i}")
        demo = getattr(ep.env, "demonstration", None)
        if demo is None:
            raise ValueError(f"env.name={rollout.cfg.env.name}: the environment has no demonstration(seed) for the "
                             "SFT warm-up (set sft.steps=0)")
        pairs: list[tuple[list[int], list[int]]] = []
        for text in demo(env_seed(ex)):
            if not ep.wants_action():
                break
            ids = list(tok(text, add_special_tokens=False).input_ids) + [tok.eos_token_id]
            pairs.append((ep.context(), ids))
            ep.apply(ids, [0.0] * len(ids), 0, "stop")
        demos.append(pairs)
    return demos


def sft_pairs(rollout: EpisodeRollout, examples: Sequence[TaskExample]) -> list[tuple[list[int], list[int]]]:
    """The pairs of :func:`sft_demonstrations`, flat: every demonstrated turn of ``examples`` in order."""
    return [pair for demo in sft_demonstrations(rollout, examples) for pair in demo]

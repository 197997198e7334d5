"""Multi-turn environments and the episode rollout that turns one into a trajectory.

An :class:`Environment` has ``reset(seed) -> observation`` and ``step(action_text) ->
StepResult(observation, reward_parts, done, truncated, info)``. :func:`run_episode` alternates
policy turns and environment steps and builds one :class:`~posttrain.trajectory.Trajectory`:

- the first observation (rendered as a user turn) is ``prompt`` tokens;
- each policy turn is ``action`` tokens (``action_mask = 1``, the sampler's log-probs and
  versions);
- each later observation (tool output + the template's turn markers) is ``observation`` tokens
  with ``action_mask = 0``, so it never enters a policy ratio or a loss.

The context the policy sees next is exactly the accumulated token ids (never a re-tokenisation
of the rendered text), so the recorded tokens are the ones the behavior policy was conditioned
on. Turns are rendered with the tokenizer's ``apply_chat_template`` when it has a chat template
(user turn for the first observation, ``tool`` turns after), else as plain text.

Ends: ``done`` from the environment -> ``Finish.TERMINAL``; the turn limit, the token budget,
an environment's own ``truncated``, or a policy turn cut by its length limit -> ``Finish.TRUNCATED``
(not terminal: value targets must not treat it as an end). An exception raised by the
environment is ``Status.ENV_FAILURE`` with no reward total (counted, never a zero).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from posttrain.trajectory import Finish, Reward, Role, Status, Trajectory
from posttrain.trajectory.record import StepRecord

if TYPE_CHECKING:
    from posttrain.models.tokenizer_protocol import Tokenizer

GenerateFn = Callable[[list[int]], tuple[Sequence[int], Sequence[float], Sequence[int] | int, str]]
"""``generate_fn(context_ids) -> (token_ids, logprobs, versions, finish_reason)`` for one policy
turn; ``finish_reason`` is ``"stop"`` (ended with eos) or ``"length"``."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One environment step. ``reward_parts`` are raw components (summed over the episode);
    ``info["status"]`` (a :class:`Status` value), if given on the last step, is the episode's
    verdict."""

    observation: str
    reward_parts: Mapping[str, float] = dataclasses.field(default_factory=dict)
    done: bool = False
    truncated: bool = False
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A multi-turn environment (one episode at a time).

    Optional: ``reward_components``, a tuple of the reward part names its steps may report (e.g.
    ``("task", "tool_calls", "invalid_actions")``). An environment that declares them has
    ``reward.weights`` checked against them at config load (:func:`declared_components`), and a
    declared part an episode never reported counts 0 in its verdict (a count of zero tool calls is a
    real 0); without a declaration a weighted part missing from a terminal episode is an ``env_failure``.
    """

    name: str

    def reset(self, seed: int) -> str:
        """Start an episode; returns the first observation (the task statement)."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Apply one policy turn's text."""
        ...


class TurnRenderer:
    """Renders turns to token ids, through the chat template when the tokenizer has one.

    ``tools``: JSON schemas (``{"type": "function", "function": {name, description, parameters}}``)
    the model may call. ``tool_prompt`` decides how they reach the model: ``"template"`` passes
    them to ``apply_chat_template(..., tools=...)`` (the model family's own tool format, e.g.
    Qwen / Hermes); ``"preamble"`` writes :func:`tool_preamble` as the system message (or before
    the first observation without a chat template); ``"auto"`` = template when the chat template
    mentions ``tools``, else preamble; ``"none"`` = not shown (a model taught the format by SFT).
    """

    def __init__(self, tokenizer: Tokenizer, use_chat_template: bool = True, system: str | None = None,
                 tools: Sequence[Mapping[str, Any]] | None = None, tool_prompt: str = "auto") -> None:
        if tool_prompt not in ("auto", "template", "preamble", "none"):
            raise ValueError(f"tool_prompt must be auto, template, preamble or none, got {tool_prompt!r}")
        self.tok = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.chat = bool(use_chat_template and template)
        self.tools = [dict(t) for t in tools] if tools else None
        mode = tool_prompt
        if mode == "auto":
            mode = "template" if self.chat and "tools" in str(template) else "preamble"
        if mode == "template" and not self.chat:
            raise ValueError("tool_prompt=template needs a tokenizer with a chat template")
        self.tool_mode = mode if self.tools else "none"
        if self.tool_mode == "preamble":
            assert self.tools is not None
            system = tool_preamble(self.tools) + (f"\n{system}" if system else "")
        self.system = system
        self.eos = tokenizer.eos_token or ""

    def _render(self, msgs: list[dict[str, Any]], gen: bool) -> str:
        extra = {"tools": self.tools} if self.tool_mode == "template" else {}
        return str(self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **extra))

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def first(self, observation: str) -> tuple[list[int], list[dict[str, str]]]:
        """Prompt ids of the first observation and the message list so far."""
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": observation}]
        if not self.chat:
            return self._ids(f"{self.system}\n{observation}" if self.system else observation), msgs
        return self._ids(self._render(msgs, gen=True)), msgs

    def after(self, msgs: list[dict[str, str]], action_text: str, ended_with_eos: bool,
              observation: str) -> list[int]:
        """Ids between the end of the sampled action and the start of the next policy turn.

        = the template's closing of the assistant turn not already sampled (e.g. ``<eos>`` if
        the model did not emit it, a newline after ``<|im_end|>``) + the tool turn + the next
        generation prompt. ``msgs`` is extended in place.
        """
        msgs.append({"role": "assistant", "content": action_text})
        if not self.chat:
            msgs.append({"role": "tool", "content": observation})
            return self._ids(f"\n{observation}\n")
        upto = self._render(msgs, gen=False)
        end = upto.rfind(action_text) + len(action_text) if action_text else len(upto)
        closing = upto[end:]
        if ended_with_eos and self.eos and closing.startswith(self.eos):
            closing = closing[len(self.eos):]
        msgs.append({"role": "tool", "content": observation})
        full = self._render(msgs, gen=True)
        if not full.startswith(upto):
            raise ValueError("chat template is not prefix-stable: adding a tool turn changed earlier text")
        return self._ids(closing + full[len(upto):])


class EpisodeState:
    """One episode advanced one policy turn at a time (so many episodes can share one engine call).

    ``start()`` resets the environment and renders the first observation; then, while
    :meth:`wants_action` is true, :meth:`context` is the exact token list the next policy turn is
    conditioned on and :meth:`apply` records that turn (``action`` tokens, their log-probs and
    versions) and steps the environment (its observation becomes ``observation`` tokens with
    ``action_mask = 0``); :meth:`trajectory` builds the record. Limits: ``max_turns`` policy turns,
    ``max_tokens`` over the whole flattened sequence, ``max_wall_s`` seconds since ``start`` (None:
    none; time spent :meth:`suspend`-ed between turns does not count); each ends the episode as
    ``Finish.TRUNCATED``. An exception of the environment (reset or
    step) or a malformed turn is ``Status.ENV_FAILURE`` with no reward total.

    Per step ``t`` (GiGPO, Feng et al. 2025, arXiv:2505.10978) it keeps ``step_anchors[t]`` = a
    63-bit hash of the environment state before the step (``env.state_key()`` when the environment
    has one, else the observation text the step answered) and ``step_rewards[t]`` = the weighted
    sum of the step's ``reward_parts``.
    """

    def __init__(self, env: Environment, tokenizer: Tokenizer, *, seed: int, traj_id: str, group_id: str,
                 prompt_id: str | None = None, max_turns: int = 4, max_tokens: int = 512,
                 max_wall_s: float | None = None, weights: Mapping[str, float] | None = None,
                 use_chat_template: bool = True, system: str | None = None, tool_prompt: str = "auto",
                 fallback_prompt_ids: Sequence[int] | None = None) -> None:
        if max_turns < 1 or max_tokens < 1:
            raise ValueError(f"episode: max_turns and max_tokens must be >= 1, got {max_turns}, {max_tokens}")
        self.env, self.tok, self.seed = env, tokenizer, seed
        self.traj_id, self.group_id = traj_id, group_id
        self.prompt_id = prompt_id or f"{env.name}/{seed}"
        self.max_turns, self.max_tokens, self.max_wall_s = max_turns, max_tokens, max_wall_s
        self.weights = dict(weights or {"task": 1.0})
        tools = [t.schema() for t in getattr(env, "tools", None) or []]
        self.renderer = TurnRenderer(tokenizer, use_chat_template, system, tools=tools or None,
                                     tool_prompt=tool_prompt)
        self.fallback = list(fallback_prompt_ids or [])
        self.ids: list[int] = []
        self.roles: list[Role] = []
        self.lps: list[float] = []
        self.vers: list[int] = []
        self.comps: dict[str, float] = {}
        self.status: Status | None = None
        self.finish = Finish.TRUNCATED
        self.explanation = ""
        self.turns = 0
        self.transcript: list[str] = []
        self.step_anchors: list[int] = []
        self.step_rewards: list[float] = []
        self.turn_tokens: list[int] = []  # action tokens of each step (GiGPO's step_index)
        self.done = False
        self.pauses = 0  # times the episode was suspended between turns and resumed (partial rollout)
        self._paused_at: float | None = None
        self._msgs: list[dict[str, Any]] = []
        self._obs = ""
        self._t0 = 0.0

    def _add(self, tokens: Sequence[int], role: Role, logp: Sequence[float] | None = None,
             ver: Sequence[int] | None = None) -> None:
        self.ids.extend(int(t) for t in tokens)
        self.roles.extend([role] * len(tokens))
        self.lps.extend(logp if logp is not None else [0.0] * len(tokens))
        self.vers.extend(ver if ver is not None else [-1] * len(tokens))

    def infra_fail(self, reason: str) -> None:
        """End the episode as ``infra_error`` (the rollout infrastructure could not serve its turn):
        no reward, excluded from the update, counted — never a zero reward."""
        self.status, self.explanation, self.done = Status.INFRA_ERROR, f"rollout infra error: {reason}", True

    def fail(self, e: BaseException) -> None:
        """End the episode as ``env_failure`` (no reward total) with ``e`` as the explanation."""
        self.status, self.explanation, self.done = Status.ENV_FAILURE, f"{type(e).__name__}: {e}", True

    def start(self) -> EpisodeState:
        """Reset the environment and render the first observation (``prompt`` tokens).

        A reset that raises is an ``env_failure`` whose prompt is ``fallback_prompt_ids``
        (re-raised when there is none: a trajectory needs at least one token)."""
        self._t0 = time.perf_counter()
        try:
            obs = self.env.reset(self.seed)
            first, self._msgs = self.renderer.first(obs)
        except Exception as e:  # noqa: BLE001 - an environment crash is an explicit, counted env_failure
            if not self.fallback:
                raise
            self._add(self.fallback, Role.PROMPT)
            self.fail(e)
            return self
        self._add(first, Role.PROMPT)
        self._obs = obs
        self.transcript.append(f"obs: {obs}")
        return self

    def wants_action(self) -> bool:
        """Whether the episode is live and within its limits (else it is ended, as truncated)."""
        if self.done:
            return False
        why = ""
        if self.turns >= self.max_turns:
            why = f"turn limit {self.max_turns} reached"
        elif len(self.ids) >= self.max_tokens:
            why = f"token budget {self.max_tokens} reached"
        elif self.max_wall_s is not None and time.perf_counter() - self._t0 > self.max_wall_s:
            why = f"wall-time limit {self.max_wall_s} s reached"
        if why:
            self.explanation, self.done = why, True
        return not self.done

    def suspend(self) -> None:
        """The episode is paused between turns (partial rollout): stop its wall-time clock."""
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """Resume a suspended episode: the time it waited does not count against ``max_wall_s``."""
        if self._paused_at is not None:
            self._t0 += time.perf_counter() - self._paused_at
            self._paused_at = None
            self.pauses += 1

    def truncate(self, why: str) -> None:
        """End the live episode as truncated by an outside limit (e.g. the model's context)."""
        if not self.done:
            self.explanation, self.done = why, True

    def context(self) -> list[int]:
        """The token ids the next policy turn is conditioned on (exactly the recorded ones)."""
        return list(self.ids)

    def tokens_left(self) -> int:
        """Room left in the token budget (the next turn's ``max_new_tokens`` bound)."""
        return max(self.max_tokens - len(self.ids), 0)

    def apply(self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int] | int,
              finish_reason: str) -> None:
        """Record one policy turn and step the environment with its decoded text.

        ``finish_reason``: ``"length"`` = the turn was cut by its length limit (ends the episode as
        truncated after the environment saw it); anything else = a natural end of the turn.
        """
        try:
            a_ids = [int(t) for t in token_ids]
            vlist = [int(versions)] * len(a_ids) if isinstance(versions, int) else [int(v) for v in versions]
            if len(logprobs) != len(a_ids) or len(vlist) != len(a_ids):
                raise ValueError(f"policy turn has {len(a_ids)} tokens, {len(logprobs)} log-probs, "
                                 f"{len(vlist)} versions")
            self._add(a_ids, Role.ACTION, [float(x) for x in logprobs], vlist)
            self.turn_tokens.append(len(a_ids))
            self.turns += 1
            text = str(self.tok.decode(a_ids, skip_special_tokens=True))
            self.transcript.append(f"act: {text}")
            ended_eos = bool(a_ids) and a_ids[-1] == self.tok.eos_token_id
            key_fn = getattr(self.env, "state_key", None)
            self.step_anchors.append(anchor_hash(str(key_fn()) if callable(key_fn) else self._obs))
            res = self.env.step(text)
            for k, v in res.reward_parts.items():
                self.comps[k] = self.comps.get(k, 0.0) + float(v)
            self.step_rewards.append(math.fsum(float(self.weights.get(k, 0.0)) * float(v)
                                               for k, v in res.reward_parts.items()))
            if res.info.get("status") is not None:
                self.status = Status(res.info["status"])
            if res.done:
                self.finish, self.explanation = Finish.TERMINAL, str(res.info.get("explanation", "done"))
                self.done = True
                return
            if res.truncated:
                self.explanation = str(res.info.get("explanation", "environment truncated the episode"))
                self.done = True
                return
            if finish_reason == "length":
                self.explanation, self.done = "policy turn hit its length limit", True
                return
            self._add(self.renderer.after(self._msgs, text, ended_eos, res.observation), Role.OBSERVATION)
            self._obs = res.observation
            self.transcript.append(f"obs: {res.observation}")
            if len(self.ids) > self.max_tokens:
                self.explanation, self.done = f"token budget {self.max_tokens} reached", True
        except Exception as e:  # noqa: BLE001 - an environment crash is an explicit, counted env_failure
            self.fail(e)

    def trajectory(self, **rest: Any) -> Trajectory:
        """The episode's record (``rest``: extra :class:`Trajectory` fields, e.g. ``sampling``).

        Reward: components = sum of ``reward_parts`` over steps, ``total = sum_k weights[k] *
        components[k]``. A truncated episode scores 0 for weighted components it never produced
        (no answer within the limits is a real outcome), and so does any episode for a weighted
        component the environment declares (``reward_components``: e.g. ``tool_calls`` of an
        episode that called no tool); a terminal one that lacks an undeclared weighted component is
        an ``env_failure`` (a silent 0 would hide a broken environment).
        """
        from posttrain.rewards.compose import compose

        status, explanation = self.status, self.explanation
        if status is None:
            status = Status.INVALID if self.finish is Finish.TRUNCATED else Status.WRONG
        reward = Reward(components={}, weights=self.weights, total=None)
        if status not in (Status.ENV_FAILURE, Status.INFRA_ERROR):
            comps = dict(self.comps)
            declared = declared_components(self.env) or ()
            for k in self.weights:
                if self.finish is Finish.TRUNCATED or k in declared:
                    comps.setdefault(k, 0.0)  # a part the episode never reported (e.g. no tool call) is 0
            try:
                reward = compose(comps, self.weights)
            except ValueError as e:
                status, explanation = Status.ENV_FAILURE, f"environment reward: {e}"
        act = np.asarray([ro is Role.ACTION for ro in self.roles], dtype=np.int8)
        # The step record travels typed (``steps``); meta holds what a reader of the transcript wants.
        meta = {"turns": self.turns, "explanation": explanation[:500], "transcript": "\n".join(self.transcript)[:2000],
                **dict(rest.pop("meta", {}))}
        return Trajectory(
            traj_id=self.traj_id, prompt_id=self.prompt_id, group_id=self.group_id,
            token_ids=np.asarray(self.ids, dtype=np.int64), roles=tuple(self.roles), action_mask=act,
            behavior_logprob=np.asarray(self.lps, dtype=np.float64),
            behavior_version=np.asarray(self.vers, dtype=np.int64), finish=self.finish, status=status,
            reward=reward, verifier=f"{self.env.name}@{getattr(self.env, 'version', '0')}", env_seed=self.seed,
            steps=StepRecord(tuple(self.step_anchors), tuple(self.step_rewards), tuple(self.turn_tokens)),
            timings={"episode_s": time.perf_counter() - self._t0, **dict(rest.pop("timings", {}))}, meta=meta, **rest,
        )


def declared_components(env: Environment) -> tuple[str, ...] | None:
    """The reward part names ``env`` declares (its ``reward_components``), or None when it declares none."""
    comps = getattr(env, "reward_components", None)
    if comps is None:
        return None
    if isinstance(comps, str) or not all(isinstance(c, str) for c in comps):
        raise ValueError(f"environment {getattr(env, 'name', env)!r}: reward_components must be a tuple of "
                         f"names, got {comps!r}")
    return tuple(comps)


def anchor_hash(state: str) -> int:
    """A stable non-negative 63-bit id of a state's text (GiGPO anchor; never Python's salted ``hash``)."""
    return int.from_bytes(hashlib.sha256(state.encode()).digest()[:8], "big") >> 1


def tool_preamble(tools: Sequence[Mapping[str, Any]]) -> str:
    """The plain-text tool instructions for a template without tool support: the Hermes call
    syntax, then one compact JSON schema per line."""
    lines = ['Tools (call: <tool_call>{"name": ..., "arguments": {...}}</tool_call>):']
    lines += [json.dumps(t.get("function", t), separators=(",", ":")) for t in tools]
    return "\n".join(lines)


def run_episode(
    env: Environment,
    generate_fn: GenerateFn,
    tokenizer: Tokenizer,
    *,
    seed: int,
    traj_id: str,
    group_id: str,
    prompt_id: str | None = None,
    max_turns: int = 4,
    max_tokens: int = 512,
    weights: Mapping[str, float] | None = None,
    use_chat_template: bool = True,
    system: str | None = None,
    max_wall_s: float | None = None,
) -> Trajectory:
    """Run one episode of ``env`` under ``generate_fn`` and return its trajectory.

    ``max_turns`` bounds policy turns, ``max_tokens`` the whole flattened sequence (prompt +
    actions + observations), ``max_wall_s`` the episode's wall time. Reward and statuses: see
    :class:`EpisodeState` (this is its one-episode driver; the training loop batches many
    episodes per engine call in :mod:`posttrain.loop.episode_rollout`). ``meta`` holds the
    transcript (turn texts) for audits.
    """
    ep = EpisodeState(env, tokenizer, seed=seed, traj_id=traj_id, group_id=group_id, prompt_id=prompt_id,
                      max_turns=max_turns, max_tokens=max_tokens, max_wall_s=max_wall_s, weights=weights,
                      use_chat_template=use_chat_template, system=system).start()
    while ep.wants_action():
        try:
            a_ids, a_lp, a_ver, reason = generate_fn(ep.context())
        except Exception as e:  # noqa: BLE001 - same accounting as an environment crash
            ep.fail(e)
            break
        ep.apply(a_ids, a_lp, a_ver, reason)
    return ep.trajectory()

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
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from posttrain.trajectory import Finish, Reward, Role, Status, Trajectory

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
    """A multi-turn environment (one episode at a time)."""

    name: str

    def reset(self, seed: int) -> str:
        """Start an episode; returns the first observation (the task statement)."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Apply one policy turn's text."""
        ...


class TurnRenderer:
    """Renders turns to token ids, through the chat template when the tokenizer has one."""

    def __init__(self, tokenizer: Any, use_chat_template: bool = True, system: str | None = None) -> None:
        self.tok = tokenizer
        self.chat = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
        self.system = system
        self.eos = tokenizer.eos_token or ""

    def _render(self, msgs: list[dict[str, str]], gen: bool) -> str:
        return str(self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen))

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def first(self, observation: str) -> tuple[list[int], list[dict[str, str]]]:
        """Prompt ids of the first observation and the message list so far."""
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": observation}]
        if not self.chat:
            return self._ids(observation), msgs
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


def run_episode(
    env: Environment,
    generate_fn: GenerateFn,
    tokenizer: Any,
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
) -> Trajectory:
    """Run one episode of ``env`` under ``generate_fn`` and return its trajectory.

    ``max_turns`` bounds policy turns, ``max_tokens`` the whole flattened sequence (prompt +
    actions + observations). Reward: components = sum of ``reward_parts`` over steps,
    ``total = sum_k weights[k] * components[k]`` (weights default ``{"task": 1}``; a weighted
    component the episode never produced counts as missing -> ``ValueError`` via ``compose``).
    A truncated episode scores 0 for weighted components it never produced (no answer within
    the limits is a real outcome). ``meta`` holds the transcript (turn texts) for audits.
    """
    from posttrain.rewards.compose import compose

    if max_turns < 1 or max_tokens < 1:
        raise ValueError(f"run_episode: max_turns and max_tokens must be >= 1, got {max_turns}, {max_tokens}")
    weights = dict(weights or {"task": 1.0})
    t0 = time.perf_counter()
    r = TurnRenderer(tokenizer, use_chat_template, system)
    ids: list[int] = []
    roles: list[Role] = []
    lps: list[float] = []
    vers: list[int] = []

    def add(tokens: Sequence[int], role: Role, logp: Sequence[float] | None = None,
            ver: Sequence[int] | None = None) -> None:
        ids.extend(int(t) for t in tokens)
        roles.extend([role] * len(tokens))
        lps.extend(logp if logp is not None else [0.0] * len(tokens))
        vers.extend(ver if ver is not None else [-1] * len(tokens))

    comps: dict[str, float] = {}
    status: Status | None = None
    finish = Finish.TRUNCATED
    explanation = ""
    turns = 0
    transcript: list[str] = []
    try:
        obs = env.reset(seed)
        first_ids, msgs = r.first(obs)
        add(first_ids, Role.PROMPT)
        transcript.append(f"obs: {obs}")
        while True:
            if turns >= max_turns:
                explanation = f"turn limit {max_turns} reached"
                break
            if len(ids) >= max_tokens:
                explanation = f"token budget {max_tokens} reached"
                break
            a_ids, a_lp, a_ver, reason = generate_fn(list(ids))
            a_ids = [int(t) for t in a_ids]
            vlist = [int(a_ver)] * len(a_ids) if isinstance(a_ver, int) else [int(v) for v in a_ver]
            if len(a_lp) != len(a_ids) or len(vlist) != len(a_ids):
                raise ValueError(f"generate_fn returned {len(a_ids)} tokens, {len(a_lp)} log-probs, {len(vlist)} versions")
            add(a_ids, Role.ACTION, [float(x) for x in a_lp], vlist)
            turns += 1
            text = str(tokenizer.decode(a_ids, skip_special_tokens=True))
            transcript.append(f"act: {text}")
            ended_eos = bool(a_ids) and a_ids[-1] == tokenizer.eos_token_id
            res = env.step(text)
            for k, v in res.reward_parts.items():
                comps[k] = comps.get(k, 0.0) + float(v)
            if res.info.get("status") is not None:
                status = Status(res.info["status"])
            if res.done:
                finish, explanation = Finish.TERMINAL, str(res.info.get("explanation", "done"))
                break
            if res.truncated:
                explanation = str(res.info.get("explanation", "environment truncated the episode"))
                break
            if reason == "length":
                explanation = "policy turn hit its length limit"
                break
            add(r.after(msgs, text, ended_eos, res.observation), Role.OBSERVATION)
            transcript.append(f"obs: {res.observation}")
            if len(ids) > max_tokens:
                explanation = f"token budget {max_tokens} reached"
                break
    except Exception as e:  # noqa: BLE001 - an environment crash is an explicit, counted env_failure
        if not ids:
            raise
        status, explanation = Status.ENV_FAILURE, f"{type(e).__name__}: {e}"
    if status is None:
        status = Status.INVALID if finish is Finish.TRUNCATED else Status.WRONG
    if status is Status.ENV_FAILURE:
        reward = Reward(components={}, weights=weights, total=None)
    else:
        if finish is Finish.TRUNCATED:
            # No answer within the limits: a real (zero) outcome for the missing components.
            for k in weights:
                comps.setdefault(k, 0.0)
        reward = compose(comps, weights)
    act = np.asarray([ro is Role.ACTION for ro in roles], dtype=np.int8)
    return Trajectory(
        traj_id=traj_id, prompt_id=prompt_id or f"{env.name}/{seed}", group_id=group_id,
        token_ids=np.asarray(ids, dtype=np.int64), roles=tuple(roles), action_mask=act,
        behavior_logprob=np.asarray(lps, dtype=np.float64), behavior_version=np.asarray(vers, dtype=np.int64),
        finish=finish, status=status, reward=reward, verifier=f"{env.name}@{getattr(env, 'version', '0')}", env_seed=seed,
        timings={"episode_s": time.perf_counter() - t0},
        meta={"turns": turns, "explanation": explanation[:500], "transcript": "\n".join(transcript)[:2000]},
    )


"""The ``ENVS`` registry of multi-turn environments and :class:`EnvTask`, their task-shaped view.

A recipe selects a multi-turn environment with ``env.name`` (a name here or
``'package.module:factory'``) and ``env.kwargs``; the run then holds an :class:`EnvTask` where a
single-turn run holds a task: it hands out the episodes' seeds as :class:`TaskExample` rows
(``prompt`` = the first observation, ``meta["env_seed"]``), split into train / held-out *by
problem* (the first observation's text decides, like every task), and makes one fresh
environment per episode (:meth:`EnvTask.make_env`). The episodes themselves run in
:mod:`posttrain.loop.episode_rollout`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.algos.registry import Registry
from posttrain.envs.multiturn import Environment, declared_components
from posttrain.envs.task import TaskExample, sample_split, split_of
from posttrain.envs.tool_calling import calculator_tool_env, python_tool_env
from posttrain.envs.tools import CalculatorEnv, PythonToolEnv

ENVS = Registry("env")
"""name -> factory(**kwargs) returning a fresh :class:`~posttrain.envs.multiturn.Environment`."""

ENVS.register("calculator_tool")(calculator_tool_env)
ENVS.register("python_tool")(python_tool_env)
ENVS.register("calculator_tags")(CalculatorEnv)  # the <calc>...</calc> tag protocol (no JSON tools)
ENVS.register("python_tags")(PythonToolEnv)


@dataclasses.dataclass(frozen=True)
class EnvVerifier:
    """The ``name@version`` of an environment's verdicts (the environment scores its own episodes)."""

    name: str
    version: str

    def verify(self, response: str, reference: Any, **context: Any) -> Any:
        """Not used: an environment's episodes are scored by its ``step`` (raises)."""
        raise RuntimeError(f"environment {self.name!r} scores its episodes itself; there is nothing to verify")


@dataclasses.dataclass
class EnvTask:
    """A multi-turn environment seen as a prompt source (see the module docstring).

    ``factory(**kwargs)`` makes one environment; ``heldout_fraction`` of the problems (by the
    first observation's text) are held out.
    """

    env_name: str
    factory: Callable[..., Environment]
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    heldout_fraction: float = 0.2

    def __post_init__(self) -> None:
        probe = self.make_env()
        if not isinstance(probe, Environment):
            raise ValueError(f"env.name={self.env_name!r}: the factory returned {type(probe).__name__}, which has no "
                             "reset(seed) / step(text) / name (posttrain.envs.multiturn.Environment)")
        self.verifier = EnvVerifier(str(probe.name), str(getattr(probe, "version", "0")))
        self._key = getattr(probe, "problem_key", None)

    @property
    def name(self) -> str:
        """The environment's name (prefix of prompt ids)."""
        return self.verifier.name

    def problem_key(self, prompt: str) -> str:
        """The problem a first observation states (the environment's ``problem_key(statement)`` when it has
        one, e.g. ``a*b`` and ``b*a`` as one product; else the text itself)."""
        return prompt if self._key is None else str(self._key(prompt))

    def make_env(self, **overrides: Any) -> Environment:
        """A fresh environment (``overrides`` on top of ``kwargs``, e.g. ``use_tools=False``)."""
        try:
            return self.factory(**{**dict(self.kwargs), **overrides})
        except TypeError as e:
            raise ValueError(f"env.kwargs {dict(self.kwargs)} do not fit env {self.env_name!r}: {e}") from None

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """``n`` episode starts of ``split``; same arguments -> same list.

        An episode is held out iff ``split_of(f"{name}|{first observation}", heldout_fraction)`` (a hash of
        the environment's name and its first observation). When none of the first observations drawn falls
        in ``split``, raises ``ValueError`` (one line naming ``env.name``, the environment's name and
        ``env.heldout_fraction``, and what to change)."""
        firsts: set[str] = set()
        resets = 0

        def draw(rng: Any) -> tuple[str, TaskExample]:
            nonlocal resets
            s = rng.randrange(2**31)
            resets += 1
            try:
                obs = self.make_env().reset(s)
            except Exception as e:  # noqa: BLE001 - the episode itself will end as env_failure
                obs = f"{self.name} seed {s} (reset failed: {type(e).__name__})"
            firsts.add(obs)
            return obs, TaskExample(prompt_id=f"{self.name}/{s}", prompt=obs, reference=None,
                                    meta={"env_seed": s})

        try:
            return sample_split(self.name, split, n, seed, draw, self.heldout_fraction,
                                rng_tag=repr(sorted(self.kwargs.items())))
        except ValueError:
            if firsts and all(split_of(f"{self.name}|{o}", self.heldout_fraction) != split for o in firsts):
                raise ValueError(self._empty_split(split, len(firsts), resets)) from None
            raise

    def _empty_split(self, split: str, distinct: int, resets: int) -> str:
        """The one-line refusal of a split that none of ``distinct`` first observations falls in."""
        if split == "train":
            found, todo = "all", "lower env.heldout_fraction"
        else:
            found, todo = "none", ("raise env.heldout_fraction, or make the environment's first observations "
                                   "more varied (its name is hashed with them)")
        return (f"env.name={self.env_name}: environment {self.name!r} has no episode of split {split!r}: "
                f"{found} of the {distinct} distinct first observations of {resets} resets are held out at "
                f"env.heldout_fraction={self.heldout_fraction} (an episode is held out iff "
                f"sha256('{self.name}|' + its first observation)[:8] mod 10^6 < env.heldout_fraction * "
                f"10^6); {todo}")


def build_env_task(name: str, kwargs: Mapping[str, Any] | None = None, heldout_fraction: float = 0.2) -> EnvTask:
    """The :class:`EnvTask` of ``env.name`` (an :data:`ENVS` name or ``'module:factory'``)."""
    from posttrain.algos.hyperparameters import validated_factory_kwargs
    from posttrain.dotted import import_dotted

    factory = import_dotted(name, what="env.name") if ":" in name else ENVS[name]
    typed = validated_factory_kwargs(factory, kwargs or {}, key="env.kwargs", what=f"env {name!r}")
    return EnvTask(name, factory, typed, heldout_fraction)


def check_tool_switch(name: str, kwargs: Mapping[str, Any] | None) -> None:
    """Refuse (``ValueError``, one line naming ``env.eval_without_tools``) an environment ``env.name`` whose
    factory does not build with ``use_tools=False`` on top of ``env.kwargs`` (which must build alone): the
    no-tool held-out evaluation would fail at the run's first evaluation, after its directory is written."""
    task = build_env_task(name, kwargs)
    task.make_env()  # env.kwargs alone (their own error)
    try:
        task.make_env(use_tools=False)
    except ValueError:
        raise ValueError(f"env.eval_without_tools=true: env {name!r} has no use_tools switch (its factory takes no "
                         "use_tools keyword), so there is no tool-free evaluation") from None


def check_tool_prompt(name: str, kwargs: Mapping[str, Any] | None, tool_prompt: str) -> None:
    """Refuse (``ValueError``, one line naming ``env.tool_prompt``) a tool prompt for an environment ``env.name``
    without tools (no ``tools`` to render: the setting would be ignored, ``posttrain/envs/multiturn.py``)."""
    if not getattr(build_env_task(name, kwargs).make_env(), "tools", None):
        raise ValueError(f"env.tool_prompt={tool_prompt} cannot take effect: env {name!r} has no tools (no tool "
                         "schemas to render); drop env.tool_prompt")


def check_env_reward_weights(name: str, kwargs: Mapping[str, Any] | None, weights: Mapping[str, float]) -> None:
    """Refuse (``ValueError``, one line naming the key) a ``reward.weights`` key that the environment
    ``env.name`` does not declare among its ``reward_components`` (the load-time check a single-turn
    run gets from its verifier's components). Builds one environment of ``env.kwargs`` (a bad keyword
    is refused here too); an environment that declares no components is not checked."""
    env = build_env_task(name, kwargs).make_env()
    declared = declared_components(env)
    if declared is None:
        return
    unknown = [k for k in weights if k not in declared]
    if unknown:
        raise ValueError(f"reward.weights.{unknown[0]}: env {name!r} reports no reward part {unknown[0]!r} "
                         f"(its parts: {', '.join(declared)})")

"""User reward functions by dotted path (``reward.functions`` in a recipe).

A reward function has the signature::

    def fn(response: str, reference: Any, *, prompt: str, meta: dict) -> float | Verdict
    async def fn(response: str, reference: Any, *, prompt: str, meta: dict) -> float | Verdict

``response`` is the decoded response text, ``reference`` the example's reference (what the task's
verifier compares against), ``prompt`` the example's prompt text (a chat example's last user
message) and ``meta`` the example's metadata (the task's extra columns). It returns a finite number, or a :class:`~posttrain.rewards.Verdict`
with exactly one component (its value is taken; an ``infra_error`` Verdict makes the sample an
infra error). Each function is a *raw* reward component named ``name`` (default: the function's
name); its ``weight`` enters ``reward.weights``, so the total is
``sum_k weights[k] * components[k]`` over the task verifier's components and the functions'
(:func:`posttrain.rewards.compose`). The task's verifier still decides the sample's status
(correct / wrong / invalid); the functions only add components.

A function that raises, returns a non-number, NaN or +-inf makes the sample an ``infra_error``
(no reward, counted; never a zero reward): :class:`RewardFunctionVerifier` raises, and the
verifier pool turns that into an infra error after its retries, under the same time limit as the
task's verifier. Paths are resolved and signatures checked at config load
(:func:`check_reward_function`), before any rollout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.dotted import import_dotted
from posttrain.rewards.verdict import Verdict
from posttrain.trajectory import Status


class RewardFunctionError(RuntimeError):
    """A reward function failed on a sample (raised, returned garbage): an infra error, never a reward."""


def resolve(path: str, key: str) -> Any:
    """Import ``'package.module:attr'``; ``ValueError`` naming ``key`` and ``path`` when it cannot be loaded."""
    return import_dotted(path, what=key)


def check_reward_function(path: str, key: str) -> Any:
    """Resolve ``path`` and check it can be called as ``fn(response, reference, prompt=..., meta=...)``.

    Returns the function. ``ValueError`` naming ``key`` when it is not callable or its signature
    does not accept that call (``inspect.Signature.bind``).
    """
    fn = resolve(path, key)
    if not callable(fn):
        raise ValueError(f"{key}: {path!r} is a {type(fn).__name__}, not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # a builtin without a signature: the first call will tell
    try:
        sig.bind("", None, prompt="", meta={})
    except TypeError as e:
        raise ValueError(f"{key}: {path!r}{sig} does not fit fn(response, reference, *, prompt, meta): {e}") from None
    return fn


def _run_coroutine(coro: Any) -> Any:
    """Run an awaitable to completion from sync code (in a fresh thread if this one has a running loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["v"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["e"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


def call_reward_function(fn: Any, name: str, response: str, reference: Any, *, prompt: str,
                         meta: Mapping[str, Any]) -> float | None:
    """One call of a reward function -> its finite float value, or None for an ``infra_error`` Verdict.

    Raises :class:`RewardFunctionError` naming ``name`` when the function raises or returns
    anything but a finite number or a one-component Verdict.
    """
    try:
        out = fn(response, reference, prompt=prompt, meta=dict(meta))
        if inspect.isawaitable(out):
            out = _run_coroutine(out)
    except Exception as e:  # noqa: BLE001 - the function's failure is an infra error, not a reward
        raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {e}") from None
    if isinstance(out, Verdict):
        if out.status is Status.INFRA_ERROR:
            return None
        if len(out.components) != 1:
            raise RewardFunctionError(f"reward function {name!r} returned a Verdict with components "
                                      f"{sorted(out.components)} (needs exactly one)")
        out = next(iter(out.components.values()))
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise RewardFunctionError(f"reward function {name!r} returned {type(out).__name__}, not a float")
    if not math.isfinite(float(out)):
        raise RewardFunctionError(f"reward function {name!r} returned {out!r} (not finite)")
    return float(out)


@dataclasses.dataclass
class RewardFunctionVerifier:
    """The task's verifier plus reward functions: its verdict with one more component per function.

    Picklable (the functions travel as paths and are imported again in a pool worker). Verifies
    with ``base`` first; an ``infra_error`` there stays one. ``verify`` takes the context
    ``prompt`` / ``meta`` (:func:`posttrain.rewards.scoring.verify_context` passes them).
    """

    base: Any
    functions: tuple[tuple[str, str], ...]  # (component name, 'module:function')
    wants_prompt: bool = True
    _fns: dict[str, Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        """The task verifier's name (the ledger's ``name@version`` says which functions)."""
        return str(self.base.name)

    @property
    def version(self) -> str:
        """Base version + the functions, so changing a function's path changes the recorded id."""
        return f"{self.base.version}+" + ",".join(f"{n}={p}" for n, p in self.functions)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fns": None}  # functions are re-imported by path in a worker

    def _resolved(self) -> dict[str, Any]:
        if self._fns is None:
            self._fns = {n: resolve(p, f"reward.functions[{n}]") for n, p in self.functions}
        return self._fns

    def verify(self, response: str, reference: Any, prompt: str = "", meta: Mapping[str, Any] | None = None,
               **context: Any) -> Verdict:
        """Base verdict (given ``context``) with each function's raw value added as a component."""
        base_ctx = {k: v for k, v in context.items()}
        v: Verdict = self.base.verify(response, reference, **base_ctx)
        if v.status is Status.INFRA_ERROR:
            return v
        comps = dict(v.components)
        for name, fn in self._resolved().items():
            val = call_reward_function(fn, name, response, reference, prompt=prompt, meta=meta or {})
            if val is None:
                return Verdict(Status.INFRA_ERROR, {}, f"reward function {name!r} returned an infra_error verdict")
            comps[name] = val
        return Verdict(v.status, comps, v.explanation)


def with_reward_functions(task: Any, functions: Sequence[tuple[str, str]]) -> Any:
    """``task`` whose verifier also runs ``functions`` ((name, path) pairs); ``task`` itself unchanged."""
    import copy

    verifier = RewardFunctionVerifier(task.verifier, tuple((str(n), str(p)) for n, p in functions))
    if dataclasses.is_dataclass(task) and not isinstance(task, type):
        return dataclasses.replace(task, verifier=verifier)
    out = copy.copy(task)
    out.verifier = verifier
    return out

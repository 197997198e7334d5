"""The engine registry: ``rollout.engine: NAME`` -> one :class:`EngineEntry`, the only table of the engines.

A recipe's ``rollout.engine`` key names an entry of :data:`ENGINES`;
:class:`~posttrain.config.rollout.RolloutConfig` refuses any other name in one line listing the known ones,
and the field's description is built from the entries' summaries. Everything that differs per engine outside
its own module is read from its entry:

- ``factory``: the ``"module:attr"`` path of its factory function
  ``(cfg, model, tokenizer, workdir) -> Callable[[], RolloutEngine]`` (a picklable zero-argument builder: the
  Ray rollout workers call it once per process), resolved by :func:`posttrain.loop.builders.engine_factory`;
- ``section``: the name of its own ``rollout.<section>`` key (``rollout.vllm``), or None; the dead-settings
  rules (:data:`posttrain.config.dead_settings.RULES`) refuse that section under any other engine;
- ``has_precision_axis`` / ``computes_in``: whether ``rollout.precision`` applies to it, and where its compute
  dtype is set instead (the refusal names it); held-out evaluation and ``posttrain check``
  sample with the in-process built-in engine at ``rollout.precision`` only for such an engine;
- ``runs_as_server_option`` / ``no_server_why``: whether ``rollout.process: server`` applies to it, and why
  not;
- ``samples_as_builtin``: its samples come from the built-in engine's code, so ``posttrain eval`` (the
  built-in engine in process) evaluates a run of it with the engine that sampled;
- ``check_config``: its checks of the ``rollout`` section alone (one-line ``ValueError``), run by the
  section's validator; ``check_run``: its checks of the whole config, run by
  :func:`~posttrain.config.run.check_new_run`;
- ``context_cap``: the engine context its settings impose on prompt + response (None: the model's);
- ``machine_check``: the ``"module:attr"`` path of its check of this machine ``(cfg) -> None`` (one-line
  ``ValueError``; the vLLM environment), run by :func:`posttrain.loop.validate.validate_run`, or None.

A new engine is one module with its factory function and one entry here (an engine with keys of its own also
adds its settings section to :class:`~posttrain.config.rollout.RolloutConfig`). This module is on the config
floor and imports nothing of posttrain at run time: the paths are strings, resolved by the floors that run
them.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Callable
from typing import Protocol

__all__ = ["ENGINES", "EngineEntry", "RolloutView", "RunView", "engine_entry", "engines_description", "engines_with"]


class HTTPView(Protocol):
    """The ``rollout.http`` keys the entries read (met by :class:`~posttrain.config.rollout.HTTPSettings`)."""

    @property
    def url(self) -> str | None: ...


class VLLMView(Protocol):
    """The ``rollout.vllm`` keys the entries read (met by :class:`~posttrain.config.rollout.VLLMSettings`)."""

    @property
    def dtype(self) -> str: ...

    @property
    def max_model_len(self) -> int | None: ...


class RolloutView(Protocol):
    """What an entry's predicates read of the ``rollout`` section: met by
    :class:`~posttrain.config.rollout.RolloutConfig` (a structural type: that module imports this one)."""

    @property
    def engine(self) -> str: ...

    @property
    def vllm(self) -> VLLMView: ...

    @property
    def http(self) -> HTTPView: ...


class ModelView(Protocol):
    """The ``model`` keys the entries read (met by :class:`~posttrain.config.model.ModelConfig`)."""

    @property
    def dtype(self) -> str: ...


class RunView(Protocol):
    """What an entry's ``check_run`` reads of a run's config (met by :class:`~posttrain.config.run.RunConfig`)."""

    @property
    def model(self) -> ModelView: ...

    @property
    def rollout(self) -> RolloutView: ...


def _no_check(rollout: RolloutView) -> None:
    return None


def _no_run_check(cfg: RunView) -> None:
    return None


def _no_cap(rollout: RolloutView) -> int | None:
    return None


def _vllm_cap(rollout: RolloutView) -> int | None:
    return rollout.vllm.max_model_len


def _vllm_dtype(cfg: RunView) -> None:
    if cfg.rollout.vllm.dtype == "auto" and cfg.model.dtype == "float64":
        raise ValueError("rollout.vllm.dtype: vLLM has no float64; set model.dtype=float32 or rollout.vllm.dtype")


def _http_url(rollout: RolloutView) -> None:
    url = rollout.http.url
    if url is None:
        raise ValueError("rollout.http.url is required with rollout.engine=http (http://127.0.0.1:PORT)")
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname or u.port is None:
        raise ValueError(f"rollout.http.url must look like http://host:port, got {url!r}")


@dataclasses.dataclass(frozen=True)
class EngineEntry:
    """One rollout engine (module docstring): its ``name``, one-line ``summary``, ``factory`` path and own
    ``section``, and what the config and the commands read of it instead of an ``if engine == ...`` chain."""

    name: str
    summary: str
    factory: str
    """``"module:attr"`` of ``(cfg, model, tokenizer, workdir) -> Callable[[], RolloutEngine]``."""
    section: str | None = None
    """Its own ``rollout.<section>`` key (read by its engine only), or None."""
    has_precision_axis: bool = False
    """``rollout.precision`` applies (the built-in engine's compute dtype)."""
    computes_in: str = "its own dtype"
    """Where its compute dtype is set, when ``rollout.precision`` does not apply (the refusal names it)."""
    runs_as_server_option: bool = False
    """``rollout.process: server`` applies (the engine in its own 127.0.0.1 process)."""
    no_server_why: str = "it has no server process of its own"
    """Why ``rollout.process: server`` does not apply to it (the refusal's reason)."""
    samples_as_builtin: bool = False
    """Its samples come from the built-in engine's code (``posttrain eval`` evaluates with the same engine)."""
    check_config: Callable[[RolloutView], None] = _no_check
    """Its checks of the ``rollout`` section alone: raises ``ValueError`` (one line)."""
    check_run: Callable[[RunView], None] = _no_run_check
    """Its checks of the whole config (``model.dtype`` against its own dtype): raises ``ValueError`` (one line)."""
    context_cap: Callable[[RolloutView], int | None] = _no_cap
    """The context (prompt + response) its settings cap, or None (the model's ``max_position_embeddings``)."""
    machine_check: str | None = None
    """``"module:attr"`` of its check of this machine ``(cfg) -> None`` (``validate_run``), or None."""


def _by_name(*entries: EngineEntry) -> dict[str, EngineEntry]:
    """``{entry.name: entry}`` in the given order; ``ValueError`` when two entries take one name."""
    table: dict[str, EngineEntry] = {}
    for e in entries:
        if e.name in table:
            raise ValueError(f"rollout engine {e.name!r} is registered twice")
        table[e.name] = e
    return table


_FACTORIES = "posttrain.loop.engine_factories"

ENGINES: dict[str, EngineEntry] = _by_name(
    EngineEntry("builtin", "the PyTorch engine in this process (bit-exact log-probs)", f"{_FACTORIES}:builtin_factory",
                has_precision_axis=True, computes_in="rollout.precision", runs_as_server_option=True,
                samples_as_builtin=True),
    EngineEntry("vllm", "vLLM (rollout.vllm)", f"{_FACTORIES}:vllm_factory", section="vllm",
                computes_in="rollout.vllm.dtype", no_server_why="vllm runs as a server process by rollout.vllm.python",
                check_run=_vllm_dtype, context_cap=_vllm_cap, machine_check="posttrain.loop.validate:check_vllm_env"),
    EngineEntry("http", "a running posttrain engine server (rollout.http)", f"{_FACTORIES}:http_factory",
                section="http", computes_in="the server's own model dtype",
                no_server_why="http is a server process already", check_config=_http_url),
)
"""Engine name -> entry, in the order the docs list them. A new engine is one module with its factory function
and one entry here."""


def engines_description() -> str:
    """``rollout.engine``'s description: ``NAME: summary; ...`` over :data:`ENGINES`."""
    return "; ".join(f"{e.name}: {e.summary}" for e in ENGINES.values())


def engines_with(fact: str) -> str:
    """The names of the entries whose boolean field ``fact`` holds, joined by ``/`` (``builtin`` for
    ``has_precision_axis``): what a refusal says the key applies to."""
    return "/".join(e.name for e in ENGINES.values() if getattr(e, fact))


def engine_entry(name: str) -> EngineEntry:
    """The entry of ``name``; ``ValueError`` (one line listing the known names) for any other."""
    entry = ENGINES.get(name)
    if entry is None:
        raise ValueError(f"unknown rollout engine {name!r}; known: {', '.join(ENGINES)}")
    return entry

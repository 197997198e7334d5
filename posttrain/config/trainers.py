"""The trainer registry: ``trainer: NAME`` -> one :class:`TrainerEntry`, the only table of the trainers.

A recipe's ``trainer`` key names an entry of :data:`TRAINERS`; :class:`~posttrain.config.run.RunConfig`
refuses any other name in one line listing the known ones, and its ``trainer`` field's description is built
from the entries' summaries. Everything that differs per trainer outside its own module is read from its entry:

- ``program``: the ``"module:attr"`` path of its program
  (:class:`posttrain.loop.trainer_program.TrainerProgram`: ``check(cfg)`` before the run directory is
  written, ``train(cfg, progress)``), resolved by :func:`posttrain.loop.trainer_program.load_program`, which
  ``posttrain train`` calls;
- ``samples`` / ``reads_pairs``: whether a configuration of it samples responses from the task (the RL
  preflight, a ledger, held-out task accuracy; :func:`~posttrain.config.run.check_new_run` refuses greedy
  groups) or trains on ``preference.data``'s pairs (``posttrain report`` then reports held-out pair accuracy);
- ``check_config``: its checks of the config alone (one-line ``ValueError``), run by ``check_new_run``;
- ``checks``: the ``"module:attr"`` path of ``posttrain check``'s function
  ``(cfg, prompts) -> list[CheckResult]`` (:mod:`posttrain.commands.check`), or None where it has none yet;
- ``generates`` / ``heldout`` / ``heldout_rise``: what ``posttrain eval`` and ``posttrain train`` say of its
  checkpoints and held-out evaluation;
- ``examples``: configurations that select it, for docs/trainers.md (:mod:`posttrain.config.trainer_keys`).

The keys a trainer leaves without effect are rules of :data:`posttrain.config.dead_settings.RULES` (they
read the entries' ``samples`` where that is what they mean). This module is on the config floor and imports
nothing of posttrain at run time: the paths are strings, resolved by the floors that run them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

__all__ = ["TRAINERS", "RecordedPreference", "RecordedSFT", "RecordedTrainer", "TrainerEntry", "TrainerExample",
           "TrainerView", "recorded_trainer", "trainer_entry", "trainers_description"]


class SFTView(Protocol):
    """The ``sft`` keys the entries' checks read (met by :class:`~posttrain.config.algorithm.SFTConfig`)."""

    @property
    def data(self) -> str | None: ...


class PreferenceView(Protocol):
    """The ``preference`` keys the entries' predicates read (met by
    :class:`~posttrain.config.preference.PreferenceConfig`)."""

    @property
    def online(self) -> bool: ...

    @property
    def data(self) -> str | None: ...


class TrainerView(Protocol):
    """What an entry's predicates read of a run's config: met by :class:`~posttrain.config.run.RunConfig` and
    by :class:`RecordedTrainer` (a saved ``config.yaml``'s mapping). A structural type: ``RunConfig`` imports
    this module."""

    @property
    def trainer(self) -> str: ...

    @property
    def preference(self) -> PreferenceView: ...

    @property
    def sft(self) -> SFTView: ...


def _no_check(c: TrainerView) -> None:
    return None


def _always(c: TrainerView) -> bool:
    return True


def _never(c: TrainerView) -> bool:
    return False


def _online(c: TrainerView) -> bool:
    return c.preference.online


def _offline(c: TrainerView) -> bool:
    return not c.preference.online


def _needs_pairs(c: TrainerView) -> None:
    if c.preference.data is None:
        raise ValueError(f"trainer={c.trainer} needs preference.data (a JSONL or Parquet file of pairs)")


def _needs_pairs_or_online(c: TrainerView) -> None:
    if not c.preference.online and c.preference.data is None:
        raise ValueError(f"trainer={c.trainer} needs preference.data (a JSONL or Parquet file of pairs) or "
                         "preference.online=true")


def _needs_sft_data(c: TrainerView) -> None:
    if c.sft.data is None:
        raise ValueError("trainer=sft needs sft.data (a JSONL or Parquet file of chat or prompt-completion rows)")


@dataclasses.dataclass(frozen=True)
class TrainerExample:
    """A configuration that selects a trainer: ``key`` (an id in docs/trainers.md and the tests), ``title`` (how
    the docs name it) and ``data`` (the config mapping, defaults otherwise)."""

    key: str
    title: str
    data: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class TrainerEntry:
    """One trainer (module docstring): its ``name``, one-line ``summary`` and ``program`` path, and what the
    commands and the config read of it instead of an ``if trainer == ...`` chain."""

    name: str
    summary: str
    program: str
    samples: Callable[[TrainerView], bool]
    reads_pairs: Callable[[TrainerView], bool]
    checks: str | None
    examples: tuple[TrainerExample, ...]
    check_config: Callable[[TrainerView], None] = _no_check
    """Its checks of the config alone: raises ``ValueError`` (one line) for a combination it cannot run."""
    generates: bool = True
    """Its checkpoints hold a policy that generates (False: a reward model, which scores)."""
    heldout: str = "held-out task accuracy"
    """What its held-out evaluation measures (``posttrain eval`` names it for a run that sampled no task)."""
    heldout_rise: bool = False
    """``posttrain train`` prints the measured held-out rise (first -> last, 95% intervals) after its done line."""


def _by_name(*entries: TrainerEntry) -> dict[str, TrainerEntry]:
    """``{entry.name: entry}`` in the given order; ``ValueError`` when two entries take one name."""
    table: dict[str, TrainerEntry] = {}
    for e in entries:
        if e.name in table:
            raise ValueError(f"trainer {e.name!r} is registered twice")
        table[e.name] = e
    return table


_PAIRS = "held-out pair accuracy on preference.data"

TRAINERS: dict[str, TrainerEntry] = _by_name(
    TrainerEntry("rl", "the policy on verifiable rewards", "posttrain.loop.training_loop:PROGRAM", _always, _never,
                 "posttrain.commands.check:run_rl_checks", (
                     TrainerExample("rl", "`trainer: rl` (grpo, ppo, dapo, ... every RL recipe)", {}),
                     TrainerExample("distill", "`trainer: rl` with `loss.distill.only: true` (on-policy distillation: "
                                    "`distill`, `smollm2_distill_word_problems`)",
                                    {"loss": {"distill": {"teacher": "builtin:micro", "only": True}}})),
                 heldout_rise=True),
    TrainerEntry("preference", "a preference loss on pairs, preference.*: offline from preference.data or online "
                 "from the run's own groups", "posttrain.loop.preference_training:PROGRAM", _online, _offline,
                 "posttrain.commands.check:preference_checks", (
                     TrainerExample("preference_offline", "`trainer: preference`, offline (`dpo`)",
                                    {"trainer": "preference", "preference": {"data": "pairs.jsonl"}}),
                     TrainerExample("preference_online", "`trainer: preference` with `preference.online: true` "
                                    "(`dpo_online`)", {"trainer": "preference", "preference": {"online": True}})),
                 _needs_pairs_or_online, heldout=_PAIRS),
    TrainerEntry("reward_model", "a Bradley-Terry reward model on preference.data",
                 "posttrain.loop.reward_model_training:PROGRAM", _never, _always,
                 "posttrain.commands.check_reward_model:reward_model_checks", (
                     TrainerExample("reward_model", "`trainer: reward_model` (`reward_model`)",
                                    {"trainer": "reward_model", "preference": {"data": "pairs.jsonl"}}),),
                 _needs_pairs, generates=False, heldout=_PAIRS),
    TrainerEntry("sft", "supervised fine-tuning on chat / prompt-completion JSONL or Parquet (sft.data), "
                 "assistant-only loss", "posttrain.loop.sft_training:PROGRAM", _never, _never,
                 "posttrain.commands.check_sft:sft_checks",
                 (TrainerExample("sft", "`trainer: sft` (`sft`)", {"trainer": "sft", "sft": {"data": "chats.jsonl"}}),),
                 _needs_sft_data, heldout="held-out loss on sft.data"),
)
"""Trainer name -> entry, in the order the docs list them. A new trainer is one module with its ``PROGRAM``
and one entry here (its dead keys, if any, are rules of :data:`posttrain.config.dead_settings.RULES`)."""


def trainers_description() -> str:
    """``RunConfig.trainer``'s description: ``what trains: NAME (summary), ...`` over :data:`TRAINERS`."""
    return "what trains: " + ", ".join(f"{e.name} ({e.summary})" for e in TRAINERS.values())


def trainer_entry(name: str) -> TrainerEntry:
    """The entry of ``name``; ``ValueError`` (one line listing the known names) for any other."""
    entry = TRAINERS.get(name)
    if entry is None:
        raise ValueError(f"unknown trainer {name!r}; known: {', '.join(TRAINERS)}")
    return entry


@dataclasses.dataclass(frozen=True)
class RecordedPreference:
    """The ``preference`` keys of a saved ``config.yaml`` that the predicates read (:class:`PreferenceView`)."""

    online: bool = False
    data: str | None = None


@dataclasses.dataclass(frozen=True)
class RecordedSFT:
    """The ``sft`` keys of a saved ``config.yaml`` that the checks read (:class:`SFTView`)."""

    data: str | None = None


@dataclasses.dataclass(frozen=True)
class RecordedTrainer:
    """A :class:`TrainerView` of a run's saved ``config.yaml`` mapping (``posttrain report`` and ``eval`` read the
    file without validating the whole config): its ``trainer`` (default ``rl``), ``preference`` and ``sft`` keys."""

    trainer: str
    preference: RecordedPreference
    sft: RecordedSFT


def recorded_trainer(data: Mapping[str, Any], source: str) -> tuple[TrainerEntry, RecordedTrainer]:
    """The entry and view of a saved ``config.yaml``'s mapping ``data`` (missing keys: their defaults);
    ``ValueError`` (one line starting with ``source``, the file) when its ``trainer`` is no known name."""
    def section(name: str) -> Mapping[str, Any]:
        v = data.get(name)
        return v if isinstance(v, Mapping) else {}

    def path(value: Any) -> str | None:
        return None if value is None else str(value)

    pref = section("preference")
    view = RecordedTrainer(str(data.get("trainer", "rl")),
                           RecordedPreference(bool(pref.get("online", False)), path(pref.get("data"))),
                           RecordedSFT(path(section("sft").get("data"))))
    try:
        return trainer_entry(view.trainer), view
    except ValueError as e:
        raise ValueError(f"{source}: trainer: {e}") from None

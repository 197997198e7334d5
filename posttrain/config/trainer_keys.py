"""Per trainer, the keys it refuses (or warns about) because it never reads them: generated from the rules.

The one table of what cannot take effect is :data:`posttrain.config.dead_settings.RULES`. This module reads it
per trainer (each example configuration of the registry :data:`posttrain.config.trainers.TRAINERS`), so
docs/trainers.md cannot drift from the code: a rule belongs to a trainer when it fires on that trainer's
configuration and not on every trainer's (so ``lora.alpha`` with ``lora.rank=0``, which every trainer's defaults
share, is not listed). ``python -m posttrain.config.trainer_keys`` prints the table, which
tests/config/test_trainer_keys.py compares with the docs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from posttrain.config.dead_settings import RULES, Rule
from posttrain.config.run import RECORDED, RunConfig
from posttrain.config.trainers import TRAINERS

__all__ = ["EXAMPLES", "TrainerKeys", "trainer_keys", "trainer_keys_markdown"]

EXAMPLES: dict[str, tuple[str, dict[str, Any]]] = {
    x.key: (x.title, dict(x.data)) for e in TRAINERS.values() for x in e.examples}
"""Example id -> (how the docs name it, the config mapping that selects it): the registry's
:attr:`~posttrain.config.trainers.TrainerEntry.examples`, in its order."""


@dataclasses.dataclass(frozen=True)
class TrainerKeys:
    """What one trainer leaves unread: ``refused`` and ``warned`` rules (keys, why), and the top-level sections
    it reads (every section none of its rules covers whole)."""

    trainer: str
    title: str
    refused: tuple[Rule, ...]
    warned: tuple[Rule, ...]
    reads: tuple[str, ...]


def trainer_keys(trainer: str) -> TrainerKeys:
    """The rules of :data:`~posttrain.config.dead_settings.RULES` that fire on ``trainer``'s configuration
    (an id of :data:`EXAMPLES`, defaults otherwise) and not on every example's, split by severity, and the sections
    it reads."""
    configs = {name: RunConfig.model_validate(data, context=RECORDED) for name, (_, data) in EXAMPLES.items()}
    title, cfg = EXAMPLES[trainer][0], configs[trainer]
    own = [r for r in RULES if r.dead(cfg) and not all(r.dead(c) for c in configs.values())]
    whole = {k for r in own if r.severity == "error" for k in r.keys if "." not in k}
    sections = [name for name, f in RunConfig.model_fields.items()
                if isinstance(f.default_factory, type) and name not in whole]
    return TrainerKeys(trainer, title, tuple(r for r in own if r.severity == "error"),
                       tuple(r for r in own if r.severity == "warn"), tuple(sections))


def _keys(rule: Rule) -> str:
    return ", ".join(f"`{k}.*`" if "." not in k else f"`{k}`" for k in rule.keys)


def trainer_keys_markdown() -> str:
    """The per-trainer table of docs/trainers.md (markdown), in :data:`EXAMPLES` order."""
    out: list[str] = []
    for trainer in EXAMPLES:
        t = trainer_keys(trainer)
        out.append(f"### {t.title}\n")
        out.append("Reads the sections " + ", ".join(f"`{s}`" for s in t.reads) + " (less the keys below).\n")
        out.append("| keys | at load | why |")
        out.append("|---|---|---|")
        for sev, rules in (("refused", t.refused), ("warned", t.warned)):
            for r in rules:
                out.append(f"| {_keys(r)} | {sev} | {r.why.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(trainer_keys_markdown(), end="")

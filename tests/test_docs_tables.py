"""The tables of docs/architecture.md that mirror code are the ones scripts/gen_doc_tables.py generates from it:
the trainer registry (``TRAINERS``) and the dead-settings rules (``RULES``). A change to either without
regenerating the doc fails here, naming the command."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gen_doc_tables.py"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_doc_tables", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_doc_tables", mod)
    spec.loader.exec_module(mod)
    return mod


GEN = _generator()


@pytest.mark.parametrize("name", list(GEN.TABLES))
def test_the_docs_table_is_the_generated_one(name: str) -> None:
    text = GEN.DOC.read_text(encoding="utf-8")
    assert GEN.table_in_doc(text, name) == GEN.TABLES[name](), \
        f"docs/architecture.md's {name!r} table differs from the code; regenerate: python scripts/gen_doc_tables.py"


def test_every_rule_and_every_trainer_has_a_row() -> None:
    from posttrain.config.dead_settings import RULES
    from posttrain.config.trainers import TRAINERS

    rules = GEN.dead_settings_table().splitlines()[2:]
    assert len(rules) == len(RULES)
    trainers = GEN.trainers_table().splitlines()[2:]
    assert [row.split("|")[1].strip() for row in trainers] == [f"`{n}`" for n in TRAINERS]


def test_replace_table_rewrites_only_the_block() -> None:
    doc = f"intro\n{GEN.begin('x')}\nold\n{GEN.END}\noutro\n"
    assert GEN.replace_table(doc, "x", "new\n") == f"intro\n{GEN.begin('x')}\nnew\n{GEN.END}\noutro\n"
    with pytest.raises(ValueError, match="no '<!-- generated: python scripts/gen_doc_tables.py y -->'"):
        GEN.table_in_doc(doc, "y")

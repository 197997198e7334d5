"""Pairs files: a duplicate pair (same prompt, chosen, rejected, whitespace aside) and a chosen equal to its
rejected up to whitespace are refused in one line naming the file and the row(s), in JSONL and Parquet.

Before: both loaded silently (the duplicate trained with double weight unless an id column was mapped,
and then only a repeated id was refused; "4" vs "4 " was a pair)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from posttrain.envs.preference_data import load_preference_pairs
from posttrain.errors import UserError


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


WRITERS = {"jsonl": _jsonl, "parquet": _parquet}

DUP = [{"prompt": "2+2=", "chosen": "4", "rejected": "5", "i": 1},
       {"prompt": "1+1=", "chosen": "2", "rejected": "3", "i": 2},
       {"prompt": "2+2= ", "chosen": " 4", "rejected": "5\n", "i": 3}]  # row 0 again, whitespace aside


@pytest.mark.parametrize("fmt", sorted(WRITERS))
@pytest.mark.parametrize("fields", [None, {"id": "i"}], ids=["no_id", "distinct_ids"])
def test_a_duplicate_pair_is_refused_naming_file_and_both_rows(tmp_path: Path, fmt: str,
                                                               fields: dict[str, str] | None) -> None:
    f = WRITERS[fmt](tmp_path / f"d.{fmt}", DUP)
    with pytest.raises(UserError, match=r"rows 0 and 2: the same pair \(prompt, 'chosen', 'rejected'") as e:
        load_preference_pairs(f, fields)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_a_chosen_equal_to_its_rejected_up_to_whitespace_is_refused_naming_file_and_row(tmp_path: Path,
                                                                                      fmt: str) -> None:
    rows = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"},
            {"prompt": "1+1=", "chosen": "the  answer is\t2", "rejected": " the answer is 2\n"}]
    f = WRITERS[fmt](tmp_path / f"w.{fmt}", rows)
    with pytest.raises(UserError, match=r": row 1: fields 'chosen' and 'rejected' differ only in whitespace") as e:
        load_preference_pairs(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_chats_repeating_one_pair_are_a_duplicate_and_distinct_pairs_load(tmp_path: Path) -> None:
    conv = [{"role": "user", "content": "hi"}]
    row = {"chosen": conv + [{"role": "assistant", "content": "hello"}],
           "rejected": conv + [{"role": "assistant", "content": "no"}]}
    with pytest.raises(UserError, match=r"rows 0 and 1: the same pair"):
        load_preference_pairs(_jsonl(tmp_path / "c.jsonl", [row, row]))
    # one prompt, two different rejected responses; one response pair under two prompts: all distinct pairs
    ok = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "a", "rejected": "c"},
          {"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "b", "rejected": "a"}]
    assert len(load_preference_pairs(_jsonl(tmp_path / "ok.jsonl", ok))) == 4

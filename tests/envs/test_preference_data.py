"""Preference pairs from JSONL / Parquet: field mapping, chat layouts, errors naming file, row and column,
and the hash split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from posttrain.envs.preference_data import PreferencePair, load_preference_pairs, split_pairs
from posttrain.errors import UserError


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_plain_rows(tmp_path: Path) -> None:
    f = _write(tmp_path / "p.jsonl", [{"prompt": "2+2=", "chosen": "4", "rejected": "5"},
                                      {"prompt": "1+1=", "chosen": "2", "rejected": "3"}])
    pairs = load_preference_pairs(f)
    assert pairs[0] == PreferencePair("p/0", "2+2=", "4", "5", {"source": f"{f}: row 0"})
    assert [p.pair_id for p in pairs] == ["p/0", "p/1"]


def test_field_mapping_ids_and_score_diff(tmp_path: Path) -> None:
    f = _write(tmp_path / "m.jsonl", [{"q": {"text": "hi"}, "good": "hello", "bad": "go away", "k": 7, "d": 1.5}])
    (p,) = load_preference_pairs(f, {"prompt": "q.text", "chosen": "good", "rejected": "bad", "id": "k",
                                     "score_diff": "d"})
    assert (p.pair_id, p.prompt, p.chosen, p.rejected, p.meta["score_diff"]) == ("m/7", "hi", "hello", "go away", 1.5)


def test_chat_layouts(tmp_path: Path) -> None:
    conv = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"}]
    f = _write(tmp_path / "c.jsonl", [
        # binarized: both sides repeat the conversation; no prompt column -> the shared prefix
        {"chosen": conv + [{"role": "assistant", "content": "hello"}],
         "rejected": conv + [{"role": "assistant", "content": "no"}]},
        # a messages column and plain responses
        {"msgs": conv, "chosen": "hey", "rejected": "bye"},
    ])
    a, b = load_preference_pairs(f, {"messages": "msgs"})
    assert a.prompt == tuple(conv) and (a.chosen, a.rejected) == ("hello", "no")
    assert b.prompt == tuple(conv) and (b.chosen, b.rejected) == ("hey", "bye")


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "chosen": ["x", "y"], "rejected": ["z", "w"]}), f)
    assert [(p.prompt, p.chosen, p.rejected) for p in load_preference_pairs(f)] == [("a", "x", "z"), ("b", "y", "w")]


@pytest.mark.parametrize(("rows", "fields", "match"), [
    ([{"prompt": "a", "chosen": "x"}], None, r"row 0: field 'rejected' is missing"),
    ([{"prompt": "a", "chosen": "x", "rejected": "y"}, {"chosen": "x", "rejected": "y"}], None,
     r"row 1: field 'prompt' is missing"),
    ([{"prompt": "", "chosen": "x", "rejected": "y"}], None, r"row 0: field 'prompt' is an empty string"),
    ([{"prompt": "a", "chosen": "x", "rejected": "x"}], None, r"row 0: fields 'chosen' and 'rejected' hold the same"),
    ([{"prompt": "a", "chosen": 3, "rejected": "x"}], None, r"row 0: field 'chosen' must be a string or a chat"),
    ([{"prompt": "a", "chosen": [{"role": "user", "content": "x"}], "rejected": "y"}], None,
     r"row 0: field 'chosen': the last message must be a non-empty 'assistant'"),
    ([{"c": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
       "r": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "y"}]}],
     {"chosen": "c", "rejected": "r"}, r"row 0: field 'prompt' is missing and the chosen and rejected chats"),
    ([{"prompt": "a", "chosen": "x", "rejected": "y", "i": 1}, {"prompt": "b", "chosen": "x", "rejected": "y", "i": 1}],
     {"id": "i"}, r"rows 0 and 1: duplicate id 1"),
    ([{"prompt": "a", "chosen": "x", "rejected": "y", "d": -1}], {"score_diff": "d"}, r"row 0: field 'd' must be a finite"),
    ([{"prompt": "a", "chosen": "x", "rejected": "y"}], {"answer": "a"}, r"preference fields: unknown key 'answer'"),
])
def test_errors_name_file_row_and_column(tmp_path: Path, rows: list[Any], fields: dict[str, str] | None,
                                         match: str) -> None:
    f = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError, match=match) as e:
        load_preference_pairs(f, fields)
    if "preference fields" not in match:
        assert str(f) in str(e.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such preference file"):
        load_preference_pairs(tmp_path / "none.jsonl")
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(UserError, match=r"p.csv: unknown preference file suffix '.csv'"):
        load_preference_pairs(tmp_path / "p.csv")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(UserError, match=r"e.jsonl: no rows"):
        load_preference_pairs(tmp_path / "e.jsonl")
    (tmp_path / "j.jsonl").write_text('{"prompt": "a", "chosen": "x", "rejected": "y"}\n{oops\n')
    with pytest.raises(UserError, match=r"j.jsonl: row 1: not valid JSON"):
        load_preference_pairs(tmp_path / "j.jsonl")


def test_split_by_prompt_hash() -> None:
    pairs = [PreferencePair(f"t/{i}", f"prompt {i % 50}", f"c{i}", f"r{i}") for i in range(200)]
    train, held = split_pairs(pairs, 0.3)
    assert len(train) + len(held) == 200 and 0 < len(held) < 200
    held_prompts = {p.prompt for p in held}
    assert not held_prompts & {p.prompt for p in train}  # one prompt, one side
    assert split_pairs(list(reversed(pairs)), 0.3)[1] == list(reversed(held))  # order does not decide the split
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_pairs(pairs, 0.0)


def test_a_shipped_recipes_data_path_resolves_from_any_working_directory(tmp_path, monkeypatch):
    """``posttrain/recipes/data/...`` (as the shipped dpo recipe names it) is found outside the repository
    root; a relative path that exists nowhere stays as given, for the loader's "no such file" error."""
    from posttrain.config.paths import resolve_shipped_path as resolve_data_path

    monkeypatch.chdir(tmp_path)
    shipped = resolve_data_path("posttrain/recipes/data/shout_pairs.jsonl")
    assert shipped.is_absolute() and shipped.is_file()
    assert resolve_data_path("nowhere/pairs.jsonl") == Path("nowhere/pairs.jsonl")
    (tmp_path / "posttrain/recipes/data").mkdir(parents=True)
    (tmp_path / "posttrain/recipes/data/shout_pairs.jsonl").write_text("{}\n")
    assert resolve_data_path("posttrain/recipes/data/shout_pairs.jsonl") == Path("posttrain/recipes/data/shout_pairs.jsonl")

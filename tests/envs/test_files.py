"""File sources: JSONL, Parquet, HF datasets (local); field mapping; errors name file/row/field."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.envs import TASKS
from posttrain.envs.files import file_task

ROWS = [{"q": f"{i}+1=", "a": str(i + 1), "extra": {"id": f"r{i}", "lvl": i % 3}} for i in range(40)]


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_field_mapping_and_hash_split(tmp_path):
    p = _jsonl(tmp_path / "data.jsonl", ROWS)
    t = TASKS["jsonl"](path=str(p), verifier="integer", prompt_field="q", reference_field="a",
                       id_field="extra.id", meta_fields=["extra.lvl"], heldout_fraction=0.25)
    train, held = t.rows["train"], t.rows["heldout"]
    assert len(train) + len(held) == 40 and held and {e.prompt for e in train}.isdisjoint({e.prompt for e in held})
    e = next(x for x in train + held if x.prompt == "3+1=")
    assert e.prompt_id == "data/r3" and e.reference == "4" and e.meta == {"extra.lvl": 0, "answer": "4"}
    assert t.verifier.verify("4", e.reference).correct
    # deterministic, cycles past the split size, seed-dependent order
    assert t.examples("train", 70, 1) == t.examples("train", 70, 1) and len(t.examples("train", 70, 1)) == 70
    assert t.examples("train", 5, 1) != t.examples("train", 5, 2)


def test_parquet_and_hf_read_the_same_rows(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    kw = dict(verifier="exact", prompt_field="q", reference_field="a")
    a = TASKS["parquet"](path=str(tmp_path / "d.parquet"), **kw)
    b = TASKS["hf"](path=str(tmp_path / "d.parquet"), reader_kwargs={"cache_dir": str(tmp_path / "hf")}, **kw)
    c = TASKS["jsonl"](path=str(_jsonl(tmp_path / "d.jsonl", ROWS)), **kw)
    for split in ("train", "heldout"):
        assert [(e.prompt, e.reference) for e in a.rows[split]] == [(e.prompt, e.reference) for e in b.rows[split]]
        assert [e.prompt for e in a.rows[split]] == [e.prompt for e in c.rows[split]]


def test_explicit_split_files(tmp_path):
    t = file_task(splits={"train": _jsonl(tmp_path / "tr.jsonl", ROWS[:30]),
                          "heldout": _jsonl(tmp_path / "he.jsonl", ROWS[30:])},
                  prompt_field="q", reference_field="a", name="mine")
    assert len(t.rows["train"]) == 30 and len(t.rows["heldout"]) == 10 and t.name == "mine"
    with pytest.raises(ValueError, match="unknown split"):
        file_task(splits={"test": tmp_path / "he.jsonl"}, prompt_field="q", reference_field="a")


@pytest.mark.parametrize(
    "row, match",
    [
        ({"a": "1"}, r"row 1: field 'q' is missing"),
        ({"q": "", "a": "1"}, r"row 1: field 'q' must be a non-empty string"),
        ({"q": 5, "a": "1"}, r"row 1: field 'q' must be a non-empty string"),
        ({"q": "x", "a": None}, r"row 1: field 'a' is missing"),
        ({"q": "x"}, r"row 1: field 'a' is missing"),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path, row, match):
    p = _jsonl(tmp_path / "bad.jsonl", [ROWS[0], row])
    with pytest.raises(ValueError, match=rf"bad\.jsonl: {match}"):
        TASKS["jsonl"](path=str(p), prompt_field="q", reference_field="a")


def test_bad_json_and_parquet_rows(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"q": "1", "a": "2"}\n{not json\n')
    with pytest.raises(ValueError, match=r"x\.jsonl: row 1: not valid JSON"):
        TASKS["jsonl"](path=str(p), prompt_field="q", reference_field="a")
    pq.write_table(pa.Table.from_pylist([{"q": "1", "a": "2"}, {"q": None, "a": "3"}]), tmp_path / "y.parquet")
    with pytest.raises(ValueError, match=r"y\.parquet: row 1: field 'q'"):
        TASKS["parquet"](path=str(tmp_path / "y.parquet"), prompt_field="q", reference_field="a")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        TASKS["jsonl"](path=str(tmp_path / "nope.jsonl"))

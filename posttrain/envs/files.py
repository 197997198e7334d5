"""Tasks from files: JSONL, Parquet (pyarrow) and Hugging Face ``datasets`` from local files.

Each source maps its columns onto a :class:`~posttrain.envs.task.TaskExample` with a field
mapping: ``prompt_field`` (a non-empty string), ``reference_field`` (any non-null value),
optional ``id_field`` (else the row index) and ``meta_fields`` (JSON scalars). Dotted names
reach into nested records (``"extra.answer"``). Every row is validated on load; a missing or
malformed field is a ``ValueError`` naming the file, the row (0-based) and the field.

Splits: either one file per split (``{"train": a, "heldout": b}``), or one file split by a
hash of each row's prompt (:func:`~posttrain.envs.task.split_of`), so the split of a row does
not depend on its position in the file.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.envs.task import TASKS, TaskExample, check_split, resolve_verifier, split_of
from posttrain.rewards.verifier import Verifier

_MISSING = object()


def _get(row: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def iter_jsonl(path: Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """``(row, record)`` of a JSONL file; blank lines are skipped but still counted as rows."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: row {i}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}: row {i}: expected a JSON object, got {type(rec).__name__}")
            yield i, rec


def iter_parquet(path: Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """``(row, record)`` of a Parquet file (read with pyarrow)."""
    import pyarrow.parquet as pq

    yield from enumerate(pq.read_table(path).to_pylist())


def iter_hf_local(
    path: Path, builder: str | None = None, hf_split: str = "train", cache_dir: str | None = None
) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """``(row, record)`` of a local file loaded with ``datasets.load_dataset`` (extra ``datasets``).

    ``builder`` is the datasets loader (``"json"``, ``"parquet"``, ``"csv"``...; default from the
    file suffix). Only local files: nothing is fetched from the hub.
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError("reading with Hugging Face datasets needs: pip install 'posttrain[datasets]'") from e
    kind = builder or {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
    if kind is None:
        raise ValueError(f"{path}: cannot infer the datasets builder from suffix {path.suffix!r}; pass builder=")
    ds = datasets.load_dataset(kind, data_files=str(path), split=hf_split, cache_dir=cache_dir)
    yield from enumerate(ds)


_READERS = {"jsonl": iter_jsonl, "parquet": iter_parquet, "hf": iter_hf_local}


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, str | int | float | bool)


def load_examples(
    path: str | Path,
    *,
    fmt: str,
    task_name: str,
    prompt_field: str = "prompt",
    reference_field: str = "answer",
    id_field: str | None = None,
    meta_fields: Sequence[str] = (),
    reader_kwargs: Mapping[str, Any] | None = None,
) -> list[TaskExample]:
    """All rows of ``path`` as validated examples (see the module docstring for the checks)."""
    p = Path(path)
    if fmt not in _READERS:
        raise ValueError(f"unknown file format {fmt!r}; valid: {', '.join(_READERS)}")
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file")
    out: list[TaskExample] = []
    for i, rec in _READERS[fmt](p, **(reader_kwargs or {})):
        prompt = _get(rec, prompt_field)
        if prompt is _MISSING:
            raise ValueError(f"{p}: row {i}: field {prompt_field!r} is missing")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{p}: row {i}: field {prompt_field!r} must be a non-empty string, got {prompt!r:.60}")
        ref = _get(rec, reference_field)
        if ref is _MISSING or ref is None:
            raise ValueError(f"{p}: row {i}: field {reference_field!r} is missing")
        pid: Any = i
        if id_field is not None:
            pid = _get(rec, id_field)
            if pid is _MISSING or not _is_scalar(pid) or pid is None:
                raise ValueError(f"{p}: row {i}: field {id_field!r} must be a present scalar id")
        meta: dict[str, Any] = {}
        for m in meta_fields:
            v = _get(rec, m)
            if v is _MISSING or not _is_scalar(v):
                raise ValueError(f"{p}: row {i}: meta field {m!r} is missing or not a JSON scalar")
            meta[m] = v
        meta.setdefault("answer", ref if _is_scalar(ref) else json.dumps(ref))
        out.append(TaskExample(prompt_id=f"{task_name}/{pid}", prompt=prompt, reference=ref, meta=meta))
    if not out:
        raise ValueError(f"{p}: no rows")
    return out


@dataclasses.dataclass(frozen=True)
class FileTask:
    """A task over one file (hash-split) or one file per split.

    ``examples(split, n, seed)`` draws ``n`` rows from a seeded permutation of the split's rows,
    cycling (a new permutation per pass) when ``n`` exceeds the split's size.
    """

    name: str
    verifier: Verifier
    rows: Mapping[str, tuple[TaskExample, ...]]

    def examples(self, split: str, n: int, seed: int) -> list[TaskExample]:
        """See the class docstring."""
        pool = self.rows[check_split(split)]
        if not pool and n:
            raise ValueError(f"task {self.name!r}: split {split!r} is empty")
        rng = random.Random(f"{self.name}|{split}|{seed}")
        out: list[TaskExample] = []
        while len(out) < n:
            perm = list(pool)
            rng.shuffle(perm)
            out.extend(perm[: n - len(out)])
        return out


def file_task(
    path: str | Path | None = None,
    *,
    verifier: Any = "exact",
    fmt: str | None = None,
    splits: Mapping[str, str | Path] | None = None,
    heldout_fraction: float = 0.1,
    name: str | None = None,
    prompt_field: str = "prompt",
    reference_field: str = "answer",
    id_field: str | None = None,
    meta_fields: Sequence[str] = (),
    reader_kwargs: Mapping[str, Any] | None = None,
) -> FileTask:
    """Build a :class:`FileTask` from ``path`` (hash-split) or ``splits={"train":..., "heldout":...}``.

    ``fmt`` is ``"jsonl"``, ``"parquet"`` or ``"hf"`` (default from the suffix: ``.jsonl`` ->
    jsonl, ``.parquet`` -> parquet). ``verifier`` is a verifier, a registry name or
    ``{"name": ..., **kwargs}``.
    """
    if (path is None) == (splits is None):
        raise ValueError("file task: give exactly one of path= or splits=")
    v = resolve_verifier(verifier)
    files = {"all": path} if path is not None else dict(splits or {})
    tname = name or Path(str(next(iter(files.values())))).stem
    loaded: dict[str, list[TaskExample]] = {}
    for key, f in files.items():
        suffix = Path(str(f)).suffix
        kind = fmt or {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix)
        if kind is None:
            raise ValueError(f"{f}: cannot infer the format from suffix {suffix!r}; pass fmt=")
        loaded[key] = load_examples(f, fmt=kind, task_name=tname, prompt_field=prompt_field,
                                    reference_field=reference_field, id_field=id_field,
                                    meta_fields=meta_fields, reader_kwargs=reader_kwargs)
    if path is not None:
        rows: dict[str, list[TaskExample]] = {"train": [], "heldout": []}
        for ex in loaded["all"]:
            rows[split_of(f"{tname}|{ex.prompt}", heldout_fraction)].append(ex)
    else:
        unknown = set(loaded) - {"train", "heldout"}
        if unknown:
            raise ValueError(f"file task: unknown split name(s) {sorted(unknown)}; valid: train, heldout")
        rows = {"train": loaded.get("train", []), "heldout": loaded.get("heldout", [])}
    return FileTask(name=tname, verifier=v, rows={k: tuple(r) for k, r in rows.items()})


@TASKS.register("jsonl")
def jsonl_task(**kwargs: Any) -> FileTask:
    """A :func:`file_task` read as JSONL."""
    return file_task(fmt="jsonl", **kwargs)


@TASKS.register("parquet")
def parquet_task(**kwargs: Any) -> FileTask:
    """A :func:`file_task` read as Parquet (pyarrow)."""
    return file_task(fmt="parquet", **kwargs)


@TASKS.register("hf")
def hf_task(**kwargs: Any) -> FileTask:
    """A :func:`file_task` read through ``datasets.load_dataset`` from local files (never the hub)."""
    return file_task(fmt="hf", **kwargs)

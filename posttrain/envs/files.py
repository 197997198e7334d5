"""Tasks from files: JSONL, Parquet (pyarrow) and Hugging Face ``datasets`` from local files.

Each source maps its columns onto a :class:`~posttrain.envs.task.TaskExample` with a field
mapping: ``prompt_field`` (a non-empty string) or ``messages_field`` (a chat: a list of
``{role, content}`` ending with the user turn, see :class:`~posttrain.envs.task.TaskExample`),
``reference_field`` (any non-null value), optional ``id_field`` (else the row index) and
``meta_fields`` (JSON scalars, passed to reward functions as ``meta``). Dotted names
reach into nested records (``"extra.answer"``). Every row is validated on load; a missing or
malformed field, a row that is not UTF-8, a prompt id seen before (naming both rows) or a prompt
over ``max_prompt_chars`` is a ``ValueError`` naming the file, the row (0-based) and the field; so is a
reference the task's verifier cannot read (e.g. malformed LaTeX for ``math``; every distinct reference,
or a sample of a large file, :func:`~posttrain.envs.task.check_references`).
A JSONL row longer than ``max_row_bytes`` is refused without reading it whole (a 50 MB row must
not reach the tokenizer, nor memory).

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

from posttrain.envs.task import TASKS, TaskExample, check_references, check_split, resolve_verifier, split_of
from posttrain.rewards.verifier import Verifier

MISSING = object()
"""What :func:`get_dotted` returns for a key path a row does not have."""

DEFAULT_MAX_ROW_BYTES = 16 * 1024 * 1024
"""JSONL rows longer than this are refused while reading (``reader_kwargs={"max_row_bytes": ...}``)."""
DEFAULT_MAX_PROMPT_CHARS = 1_000_000
"""Prompts longer than this are refused on load, far above any model context; the exact check
against the model's context is :func:`posttrain.envs.task.check_prompts`."""


def get_dotted(row: Mapping[str, Any], dotted: str) -> Any:
    """``row[a][b]...`` for the key path ``"a.b..."``, or :data:`MISSING` where a key is absent."""
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return MISSING
        cur = cur[part]
    return cur


def iter_jsonl(path: Path, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """``(row, record)`` of a JSONL file; blank lines are skipped but still counted as rows.

    Rows are read as bytes, at most ``max_row_bytes`` at a time, and decoded one by one, so a
    non-UTF-8 row and an over-long row are errors naming the row (the long one is never read whole).
    """
    with open(path, "rb") as f:
        i = -1
        while True:
            raw = f.readline(max_row_bytes + 1)
            if not raw:
                break
            i += 1
            if len(raw) > max_row_bytes and not raw.endswith(b"\n"):
                raise ValueError(f"{path}: row {i}: longer than max_row_bytes={max_row_bytes} bytes "
                                 "(reader_kwargs={'max_row_bytes': N} raises the limit)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: row {i}: not UTF-8 text (byte {raw[e.start:e.start + 1]!r} at offset "
                                 f"{e.start} of the row)") from None
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
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    messages_field: str | None = None,
) -> list[TaskExample]:
    """All rows of ``path`` as validated examples (see the module docstring for the checks).

    With ``messages_field`` the prompt is that field's chat (``prompt_field`` is not read) and
    ``TaskExample.prompt`` its last user message.

    Each example's ``source`` is ``"<path>: row <i>"``, for errors found later (e.g. a prompt the
    tokenizer cannot encode).
    """
    p = Path(path)
    if fmt not in _READERS:
        raise ValueError(f"unknown file format {fmt!r}; valid: {', '.join(_READERS)}")
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file")
    out: list[TaskExample] = []
    seen: dict[Any, int] = {}  # prompt id -> first row
    for i, rec in _READERS[fmt](p, **(reader_kwargs or {})):
        messages = None
        if messages_field is not None:
            from posttrain.envs.prompt_render import check_messages

            raw = get_dotted(rec, messages_field)
            if raw is MISSING:
                raise ValueError(f"{p}: row {i}: field {messages_field!r} is missing")
            messages = check_messages(raw, f"{p}: row {i}: field {messages_field!r}")
            prompt = messages[-1]["content"]
            size, field = sum(len(m["content"]) for m in messages), messages_field
        else:
            prompt = get_dotted(rec, prompt_field)
            if prompt is MISSING:
                raise ValueError(f"{p}: row {i}: field {prompt_field!r} is missing")
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{p}: row {i}: field {prompt_field!r} must be a non-empty string, got {prompt!r:.60}")
            size, field = len(prompt), prompt_field
        if size > max_prompt_chars:
            raise ValueError(f"{p}: row {i}: field {field!r} has {size} characters, over "
                             f"max_prompt_chars={max_prompt_chars} (no model context holds it)")
        ref = get_dotted(rec, reference_field)
        if ref is MISSING or ref is None:
            raise ValueError(f"{p}: row {i}: field {reference_field!r} is missing")
        pid: Any = i
        if id_field is not None:
            pid = get_dotted(rec, id_field)
            if pid is MISSING or not _is_scalar(pid) or pid is None:
                raise ValueError(f"{p}: row {i}: field {id_field!r} must be a present scalar id")
            # Ids compare as the prompt ids they become (1 and "1" are the same id).
            if str(pid) in seen:
                raise ValueError(f"{p}: rows {seen[str(pid)]} and {i}: duplicate id {pid!r} (field {id_field!r})")
            seen[str(pid)] = i
        meta: dict[str, Any] = {}
        for m in meta_fields:
            v = get_dotted(rec, m)
            if v is MISSING or not _is_scalar(v):
                raise ValueError(f"{p}: row {i}: meta field {m!r} is missing or not a JSON scalar")
            meta[m] = v
        meta.setdefault("answer", ref if _is_scalar(ref) else json.dumps(ref))
        out.append(TaskExample(prompt_id=f"{task_name}/{pid}", prompt=prompt, reference=ref, meta=meta,
                               source=f"{p}: row {i}", messages=messages))
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
        pool = self.rows[check_split(split, self.name)]
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
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS,
    messages_field: str | None = None,
) -> FileTask:
    """Build a :class:`FileTask` from ``path`` (hash-split) or ``splits={"train":..., "heldout":...}``.

    ``fmt`` is ``"jsonl"``, ``"parquet"`` or ``"hf"`` (default from the suffix: ``.jsonl`` ->
    jsonl, ``.parquet`` -> parquet). ``verifier`` is a verifier, a registry name or
    ``{"name": ..., **kwargs}``. ``messages_field``: read each row's prompt as a chat from that
    field instead of ``prompt_field`` (rendered by the run's ``task.chat_template``).
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
                                    meta_fields=meta_fields, reader_kwargs=reader_kwargs,
                                    max_prompt_chars=max_prompt_chars, messages_field=messages_field)
    # Every reference the verifier can read, now (a sample of a large file): a malformed one names its row.
    check_references([ex for exs in loaded.values() for ex in exs], v, what=f"field {reference_field!r}")
    if id_field is not None:  # ids from a field must be unique across split files too (row ids are per file)
        first: dict[str, str] = {}  # prompt id -> source
        for exs in loaded.values():
            for ex in exs:
                if ex.prompt_id in first:
                    raise ValueError(f"{first[ex.prompt_id]} and {ex.source}: duplicate id {ex.prompt_id!r} "
                                     f"(field {id_field!r})")
                first[ex.prompt_id] = ex.source
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

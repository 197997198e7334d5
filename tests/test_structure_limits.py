"""Structure limits of the loop and the learner: no class over 300 lines, no function over 60 (issue 39).

Every class and function of ``posttrain/loop`` and ``posttrain/learner`` (methods and nested functions
included) is read with ``ast``; its length is ``end_lineno - lineno + 1`` of its ``class`` / ``def`` statement
(decorators not counted, docstring and comments counted). One over its limit fails the test unless it is an
entry of :data:`EXCEPTIONS`, with one sentence saying why it stays long. Like ``PENDING`` of
tests/test_import_floors.py, the list only shrinks: an entry whose definition no longer exceeds its limit (or
no longer exists) fails the test too, so a shrunk definition takes its excuse with it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "posttrain"
PACKAGES: tuple[str, ...] = ("loop", "learner")
CLASS_LIMIT = 300
FUNCTION_LIMIT = 60

EXCEPTIONS: dict[str, str] = {
    # "path under posttrain/:Qualified.name": one sentence why it stays over its limit. Empty: none is.
}
"""Definitions allowed over their limit today, each with one sentence why; the test fails on a stale entry."""


@dataclass(frozen=True)
class Definition:
    """A class or function ``name`` (``path:Qualified.name``) of ``lines`` lines, whose limit is ``limit``."""

    name: str
    lines: int
    limit: int


def definitions(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> Iterator[Definition]:
    """Every class and function (methods and nested ones included) of the ``.py`` files under
    ``root/<package>`` for each of ``packages``, with its length and limit."""
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            yield from _walk(ast.parse(path.read_text(encoding="utf-8")), rel, "")


def _walk(node: ast.AST, rel: str, prefix: str) -> Iterator[Definition]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            qual = f"{prefix}.{child.name}" if prefix else child.name
            end = child.end_lineno if child.end_lineno is not None else child.lineno
            limit = CLASS_LIMIT if isinstance(child, ast.ClassDef) else FUNCTION_LIMIT
            yield Definition(f"{rel}:{qual}", end - child.lineno + 1, limit)
            yield from _walk(child, rel, qual)
        else:
            yield from _walk(child, rel, prefix)


def too_long(defs: list[Definition]) -> dict[str, Definition]:
    """The definitions of ``defs`` over their limit, by name."""
    return {d.name: d for d in defs if d.lines > d.limit}


def test_no_class_or_function_over_its_limit() -> None:
    over = too_long(list(definitions()))
    new = sorted(set(over) - set(EXCEPTIONS))
    assert not new, (f"definitions over the limit (class {CLASS_LIMIT} lines, function {FUNCTION_LIMIT}) in "
                     f"posttrain/{{{','.join(PACKAGES)}}}: split them, or add an EXCEPTIONS entry in {__file__} with "
                     "one sentence why:\n" + "\n".join(f"  {n}: {over[n].lines} lines" for n in new))


def test_exceptions_only_shrink() -> None:
    over = too_long(list(definitions()))
    stale = sorted(set(EXCEPTIONS) - set(over))
    assert not stale, "EXCEPTIONS entries no longer over their limit (or gone; delete them):\n" + \
        "\n".join(f"  {n}" for n in stale)


def test_every_exception_says_why_in_one_sentence() -> None:
    for name, why in EXCEPTIONS.items():
        assert ":" in name and why.strip() and "\n" not in why, name


def test_methods_and_nested_functions_are_measured(tmp_path: Path) -> None:
    pkg = tmp_path / "p"
    pkg.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    (pkg / "m.py").write_text(f"class C:\n    def f(self):\n{body}\n\ndef g():\n    def h():\n        pass\n")
    got = {d.name: d.lines for d in definitions(tmp_path, ("p",))}
    assert got == {"p/m.py:C": 62, "p/m.py:C.f": 61, "p/m.py:g": 3, "p/m.py:g.h": 2}
    assert set(too_long(list(definitions(tmp_path, ("p",))))) == {"p/m.py:C.f"}

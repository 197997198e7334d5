"""Imports point down: every module of posttrain/ imports its own package or lower floors only, and no
modules import each other in a circle.

The floors are declared in :data:`FLOORS` (bottom -> top; docs/architecture.md, "Layers"). Every
``import`` counts for the floors, also one inside a function or under ``TYPE_CHECKING``: a lazy import
is still a dependency. Circles are counted among modules, also of one package, over every import
that runs (at load or in a function; ``TYPE_CHECKING`` blocks never run). One kind is left out: a
function importing its own package (``import posttrain.rewards`` in ``posttrain.rewards.verifier``, to
register the built-ins), since Python loads a module's packages before the module in any case.
A second check (:func:`types_see`) counts the ``TYPE_CHECKING`` imports too: the graph the type checker
reads has no circle either (a lower module that needs a higher one's type declares a ``Protocol`` of
what it reads, e.g. ``loop/checkpointing.py`` ``CheckpointedRun``).

:data:`PENDING` lists the violations of today that the issue-23 wave is removing, each with who
removes it: an upward import, or the one import of a circle whose removal breaks it. The test also
fails when a PENDING entry no longer occurs (no longer points up or closes a circle), so the list
only shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

ROOT = Path(__file__).resolve().parent.parent / "posttrain"
TESTS = Path(__file__).resolve().parent

FLOORS: tuple[str, ...] = (
    "errors",  # exceptions every floor raises
    "dotted",  # import_dotted: the one 'package.module:attr' plug-in loader (standard library only)
    "trajectory",  # the typed trajectory contract and the ledger
    "config",  # every config model and the recipe loader; no runtime work
    "algos",  # pure tensor functions in registries
    "models",  # builtin models and tokenizers
    "rollout",  # engines that sample
    "sandbox",  # the OS sandbox that runs untrusted code (standard library only)
    "rewards",  # verifiers, reward functions, scoring
    "envs",  # tasks and multi-turn environments
    "diagnostics",  # reading a run's files
    "learner",  # the policy / critic update
    "loop",  # the training loop and its parts (backends included)
    "evaluation",  # held-out evaluation, reports
    "bench",  # benchmarks
    "serve",  # services other clients drive (the Tinker API server)
    "commands",  # one module per posttrain command
    "cli",  # the command line
)
"""The declared floors, bottom -> top: a module may import its own floor or a lower one."""

PENDING: dict[tuple[str, str], str] = {
    # (importing module, imported module): who removes it, how. Empty: every import points down.
}
"""Today's violations (upward imports and circle edges), each removed by the named helper."""

SHIMS: dict[str, str] = {}
"""Modules left behind as re-exports of a moved one, each with who moves its last importers."""


When = Literal["load", "call", "typing"]


@dataclass(frozen=True)
class Import:
    """``importer`` imports ``imported`` (module names); ``when``: ``load`` (as the importer loads),
    ``call`` (inside a function) or ``typing`` (under ``TYPE_CHECKING``: never runs)."""

    importer: str
    imported: str
    when: When


def module_name(path: Path, root: Path = ROOT) -> str:
    """``posttrain.a.b`` of ``root/a/b.py`` (``posttrain.a`` of ``root/a/__init__.py``)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under an ``if TYPE_CHECKING:`` block (they never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                out.update(id(n) for n in ast.walk(child))
    return out


def _function_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside a function body (they run when it is called, not at load)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out.update(id(n) for n in ast.walk(node) if n is not node)
    return out


def imports_of(source: str, name: str, modules: Set[str], is_package: bool = False) -> Iterator[Import]:
    """The posttrain modules that module ``name`` (its ``source``) imports.

    ``from a.b import c`` names module ``a.b.c`` when that is a module of ``modules``, else ``a.b``;
    relative imports are resolved against ``name`` (a package's ``__init__`` when ``is_package``).
    """
    tree = ast.parse(source)
    typing_only, in_function = _type_checking_nodes(tree), _function_nodes(tree)
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else base)
        for target in targets:
            if target.split(".")[0] == "posttrain" and target != name:
                when: When = "typing" if id(node) in typing_only else "call" if id(node) in in_function else "load"
                yield Import(name, target, when)


def import_graph(root: Path = ROOT) -> list[Import]:
    """Every posttrain import of every module under ``root`` (source parsed, nothing imported)."""
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(p) for p in ROOT.rglob("*.py")}
    out: list[Import] = []
    for p in paths:
        out.extend(imports_of(p.read_text(encoding="utf-8"), module_name(p, root), modules, p.name == "__init__.py"))
    return out


def floor_of(module: str, floors: tuple[str, ...] = FLOORS) -> int:
    """The floor index of ``module`` (its package under posttrain); ``ValueError`` for an undeclared one."""
    parts = module.split(".")
    if len(parts) < 2:
        return -1  # posttrain/__init__.py itself: below everything, imports nothing
    if parts[1] not in floors:
        raise ValueError(f"{module}: package {parts[1]!r} has no floor in FLOORS")
    return floors.index(parts[1])


def upward_imports(graph: list[Import], floors: tuple[str, ...] = FLOORS) -> set[tuple[str, str]]:
    """``(importer, imported)`` of every import of a higher floor than the importer's."""
    return {(i.importer, i.imported) for i in graph if floor_of(i.imported, floors) > floor_of(i.importer, floors)}


def runs(i: Import) -> bool:
    """Whether import ``i`` counts for circles: it runs, and is not a function importing its own package."""
    return i.when == "load" or (i.when == "call" and not i.importer.startswith(i.imported + "."))


def types_see(i: Import) -> bool:
    """Whether import ``i`` counts for circles of the type checker's graph: one that runs (:func:`runs`)
    or one under ``TYPE_CHECKING`` that does not import the importer's own package."""
    return runs(i) or (i.when == "typing" and not i.importer.startswith(i.imported + "."))


def cycle_edges(graph: list[Import], counted: Callable[[Import], bool] = runs) -> set[tuple[str, str]]:
    """``(importer, imported)`` of every import that lies on a circle of the imports ``counted`` keeps
    (default: those that run, :func:`runs`; Tarjan's strongly connected components: an edge inside one
    component lies on a circle)."""
    succ: dict[str, set[str]] = {}
    for i in graph:
        if counted(i):
            succ.setdefault(i.importer, set()).add(i.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    component: dict[str, int] = {}

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component[w] = index[v]  # the component is named by its root
                if w == v:
                    break

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return {(a, b) for a, bs in succ.items() for b in bs if a in component and component.get(b) == component[a]}


def violations(graph: list[Import], floors: tuple[str, ...] = FLOORS) -> set[tuple[str, str]]:
    """Upward imports and circle edges of ``graph``."""
    return upward_imports(graph, floors) | cycle_edges(graph)


def new_violations(graph: list[Import], pending: Set[tuple[str, str]],
                   floors: tuple[str, ...] = FLOORS) -> set[tuple[str, str]]:
    """Upward imports not in ``pending``, and the edges of circles that remain once the ``pending``
    imports are gone."""
    rest = [i for i in graph if (i.importer, i.imported) not in pending]
    return upward_imports(rest, floors) | cycle_edges(rest)


def _fake(edges: Mapping[str, tuple[str, ...]], lazy: frozenset[tuple[str, str]] = frozenset()) -> list[Import]:
    return [Import(a, b, "call" if (a, b) in lazy else "load") for a, bs in edges.items() for b in bs]


def test_every_package_has_a_floor() -> None:
    for i in import_graph():
        floor_of(i.importer)
        floor_of(i.imported)


def test_imports_point_down_and_close_no_circle() -> None:
    new = sorted(new_violations(import_graph(), set(PENDING)))
    assert not new, "imports that point up or close a circle (a module may import its own floor or lower, " \
        f"FLOORS in {__file__}):\n" + "\n".join(f"  {a} -> {b}" for a, b in new)


def test_no_circle_counting_type_checking_imports() -> None:
    # Issue 39: the three circles closed by TYPE_CHECKING imports (config/dead_settings <-> config/run,
    # loop/run <-> checkpointing <-> warmup, episode_rollout <-> rollout_stage) were broken by Protocols
    # (dead_settings.RunConfigView, checkpointing.CheckpointedRun, warmup.WarmedRun,
    # episode_rollout.SamplingStage); none may come back.
    found = sorted(cycle_edges(import_graph(), counted=types_see))
    assert not found, "imports that close a circle once TYPE_CHECKING imports count (declare a Protocol of " \
        "what the lower module reads instead of importing the higher one's type):\n" + \
        "\n".join(f"  {a} -> {b}" for a, b in found)


def test_pending_only_shrinks() -> None:
    gone = sorted(set(PENDING) - violations(import_graph()))
    assert not gone, "PENDING entries that no longer occur (delete them):\n" + "\n".join(f"  {a} -> {b}" for a, b in gone)


def test_shims_only_shrink() -> None:
    graph = import_graph() + import_graph(TESTS)
    for shim, who in SHIMS.items():
        assert any(i.imported == shim for i in graph), f"nothing imports {shim} any more ({who}): delete it and " \
            "its SHIMS entry"


def test_an_upward_import_is_found() -> None:
    floors = ("low", "high")
    graph = _fake({"posttrain.high.a": ("posttrain.low.b",), "posttrain.low.b": ("posttrain.high.c",)},
                  lazy=frozenset({("posttrain.low.b", "posttrain.high.c")}))  # lazy: still a dependency
    assert upward_imports(graph, floors) == {("posttrain.low.b", "posttrain.high.c")}


def test_a_circle_inside_one_package_is_found_and_a_lazy_edge_breaks_it() -> None:
    edges = {"posttrain.p.a": ("posttrain.p.b",), "posttrain.p.b": ("posttrain.p.c",),
             "posttrain.p.c": ("posttrain.p.a", "posttrain.p.d")}
    assert cycle_edges(_fake(edges)) == {("posttrain.p.a", "posttrain.p.b"), ("posttrain.p.b", "posttrain.p.c"),
                                         ("posttrain.p.c", "posttrain.p.a")}
    # A lazy import closes a circle too (it runs when called), unless it imports the importer's own package.
    assert cycle_edges(_fake(edges, lazy=frozenset({("posttrain.p.c", "posttrain.p.a")}))) == cycle_edges(_fake(edges))
    own = {"posttrain.p": ("posttrain.p.a",), "posttrain.p.a": ("posttrain.p",)}
    assert cycle_edges(_fake(own)) == {("posttrain.p", "posttrain.p.a"), ("posttrain.p.a", "posttrain.p")}
    assert cycle_edges(_fake(own, lazy=frozenset({("posttrain.p.a", "posttrain.p")}))) == set()
    # A pending import that breaks a circle hides it; the rest of the graph is still checked.
    assert new_violations(_fake(edges), {("posttrain.p.c", "posttrain.p.a")}, ("p",)) == set()


def test_a_type_checking_import_closes_a_circle_of_the_type_checker_only() -> None:
    graph = [Import("posttrain.p.run", "posttrain.p.ck", "load"), Import("posttrain.p.ck", "posttrain.p.run", "typing")]
    assert cycle_edges(graph) == set()  # never runs
    assert cycle_edges(graph, counted=types_see) == {("posttrain.p.run", "posttrain.p.ck"),
                                                     ("posttrain.p.ck", "posttrain.p.run")}
    own = [Import("posttrain.p", "posttrain.p.a", "load"), Import("posttrain.p.a", "posttrain.p", "typing")]
    assert cycle_edges(own, counted=types_see) == set()  # a module's package is loaded before it in any case


def test_an_undeclared_package_is_refused() -> None:
    with pytest.raises(ValueError, match="'attic' has no floor"):
        floor_of("posttrain.attic.x")


def test_imports_are_read_from_the_source() -> None:
    src = ("from posttrain.p import m\nimport posttrain.q\nfrom typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n    from posttrain.r import T\n"
           "def f():\n    from posttrain.s import g\nfrom . import sib\n")
    got = set(imports_of(src, "posttrain.p.x", {"posttrain.p.m", "posttrain.p.sib"}))
    assert got == {Import("posttrain.p.x", "posttrain.p.m", "load"), Import("posttrain.p.x", "posttrain.q", "load"),
                   Import("posttrain.p.x", "posttrain.r", "typing"), Import("posttrain.p.x", "posttrain.s", "call"),
                   Import("posttrain.p.x", "posttrain.p.sib", "load")}

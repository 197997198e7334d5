"""Follow one batch through the RL step: which posttrain files its call path visits, and how often it climbs back.

Runs the ``grpo`` recipe on ``builtin:tiny`` in this process (CPU, no warm-up, 2 steps, no held-out evaluation
inside the traced step unless ``--eval``) and traces the first call of ``update_step``
(``posttrain/loop/training_loop.py``) with ``sys.setprofile``, keeping only frames whose code lives under
``posttrain/``. Nothing of posttrain is changed or wrapped.

Definitions (issue 39, "one step, a long walk"; D below):

- **hops**: a frame's hops are the number of changes of file along the posttrain frames of its stack, from the
  ``update_step`` frame (0 hops) down to it. A helper in the same file as its caller adds no hop; frames outside
  posttrain (torch, numpy, the standard library, dataclass-generated ``__init__``) are transparent.
- **walk**: the files of the posttrain functions reached within D hops of ``update_step``, each function
  (file + qualified name) taken at its first call, in call order. Later calls of a function already in the
  walk (a loop over trajectories calling a property 256 times, a second ``freeze``) add nothing: the walk
  follows where the batch's path goes, not how often.
- **stay**: a maximal run of consecutive walk entries in one file (calls within one file are one stay).
- **move**: a transition from one stay to the next (a different file): ``moves = stays - 1``.
- **climb back up**: a stay in a file the walk already visited: control re-entering a file, typically the
  caller's after it handed the batch to a callee's file (``update_step``'s own helpers called between stages,
  or a stage's file reached again).

D defaults to 1: the stages live one hop below ``update_step``: its file hands the batch to the files of
collation, the learner, the targets, the run's ledger, ...; at D=1 a stay is a stage with its same-file
helpers, and what a stage does in further files (the learner's trainer, the algorithms) is its inside. The
same definition at 96e7069 (the issue's "21 moves, 10 climbs") gives 21 stays over 11 files, 20 moves and
10 climbs. ``--depth`` changes D; the summary prints D=1..3.

Usage: ``python scripts/trace_step.py [--depth D] [--eval] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PKG = str(REPO / "posttrain") + "/"
ENTRY = ("training_loop.py", "update_step")
"""The traced function: the first call of a function of this name in a file of this name under posttrain/."""

OVERRIDES = ["model.path=builtin:tiny", "sft.steps=0", "steps=2", "eval.every=1000", "eval.size=8",
             "logging.progress=false"]
"""The grpo recipe as shipped (32 prompts x 8 samples, 4 minibatches), less the warm-up; the traced step 1
evaluates nothing (held-out runs at steps 0 and 2 only)."""


@dataclass(frozen=True)
class Call:
    """A call of posttrain function ``func`` (qualified name) in ``file`` (relative to posttrain/), ``depth``
    posttrain frames and ``hops`` file changes below ``update_step`` (module docstring)."""

    file: str
    func: str
    depth: int
    hops: int


@dataclass
class Tracer:
    """``sys.setprofile`` hook: records every call of a posttrain function within ``max_hops`` hops during the
    first call of ``update_step`` (the walk at D hops is :func:`walk` of the calls)."""

    max_hops: int
    calls: list[Call] = field(default_factory=list)
    root: types.FrameType | None = None
    done: bool = False

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if self.done or event not in ("call", "return"):
            return
        code = frame.f_code
        if not code.co_filename.startswith(PKG):
            return
        if self.root is None:
            if event == "call" and code.co_name == ENTRY[1] and code.co_filename.endswith("/" + ENTRY[0]):
                self.root = frame
                self.calls.append(Call(_rel(code.co_filename), code.co_qualname, 0, 0))
            return
        if frame is self.root:
            self.done = event == "return"
            return
        if event != "call":
            return
        chain = _posttrain_ancestors(frame, self.root)
        if chain is None:  # another thread's frame, or one outside the traced call
            return
        files = [f.f_code.co_filename for f in (*chain, self.root)]
        hops = sum(a != b for a, b in zip(files, files[1:], strict=False))
        if hops <= self.max_hops:
            self.calls.append(Call(_rel(code.co_filename), code.co_qualname, len(chain), hops))


def _rel(filename: str) -> str:
    return filename[len(PKG):]


def _posttrain_ancestors(frame: types.FrameType, root: types.FrameType) -> list[types.FrameType] | None:
    """The posttrain frames from ``frame`` (included) up to ``root`` (excluded); None when ``root`` is not on
    ``frame``'s stack."""
    out: list[types.FrameType] = []
    f: types.FrameType | None = frame
    while f is not None and f is not root:
        if f.f_code.co_filename.startswith(PKG):
            out.append(f)
        f = f.f_back
    return out if f is root else None


@dataclass(frozen=True)
class Stay:
    """A maximal run of walk entries in one ``file``: its functions in first-call order; ``climb``: the walk
    had visited ``file`` before."""

    file: str
    funcs: tuple[str, ...]
    climb: bool


def walk(calls: Sequence[Call], hops: int) -> list[Stay]:
    """The stays of the walk within ``hops`` hops (module docstring): each function's first call, consecutive
    ones in one file merged."""
    seen_funcs: set[tuple[str, str]] = set()
    seen_files: set[str] = set()
    stays: list[Stay] = []
    for c in calls:
        if c.hops > hops or (c.file, c.func) in seen_funcs:
            continue
        seen_funcs.add((c.file, c.func))
        if stays and stays[-1].file == c.file:
            stays[-1] = Stay(c.file, (*stays[-1].funcs, c.func), stays[-1].climb)
            continue
        stays.append(Stay(c.file, (c.func,), c.file in seen_files))
        seen_files.add(c.file)
    return stays


@dataclass(frozen=True)
class Counts:
    """The walk's counts (module docstring)."""

    stays: int
    files: int
    moves: int
    climbs: int


def counts(stays: Sequence[Stay]) -> Counts:
    """Stays, distinct files, moves and climbs back up of a walk."""
    return Counts(len(stays), len({s.file for s in stays}), max(len(stays) - 1, 0), sum(s.climb for s in stays))


def run_traced(max_hops: int, evaluate: bool) -> list[Call]:
    """One grpo run on builtin:tiny (:data:`OVERRIDES`) in a temporary run directory, its first ``update_step``
    traced; with ``evaluate`` the traced step also evaluates held-out (``eval.every=1``, ``eval.size=16``)."""
    sys.path.insert(0, str(REPO))
    from posttrain.loop.training_loop import train
    from posttrain.loop.validate import load_run_config

    extra = ["eval.every=1"] if evaluate else []
    tracer = Tracer(max_hops)
    with tempfile.TemporaryDirectory(prefix="trace_step_") as tmp:
        cfg = load_run_config("grpo", [*OVERRIDES, *extra, f"run_dir={tmp}/run"])
        sys.setprofile(tracer)
        try:
            train(cfg)
        finally:
            sys.setprofile(None)
    if tracer.root is None:
        raise SystemExit(f"no call of {ENTRY[1]} in posttrain/**/{ENTRY[0]}: has the step moved? (ENTRY in {__file__})")
    return tracer.calls


def main(argv: Sequence[str] | None = None) -> int:
    """Print the walk within ``--depth`` hops and the counts within 1..3 hops (module docstring)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    ap.add_argument("--depth", type=int, default=1, help="D: the walk's functions lie within D hops (default 1)")
    ap.add_argument("--eval", action="store_true", help="trace a step that also runs the held-out evaluation")
    ap.add_argument("--json", type=Path, help="also write the walk and counts here")
    ap.add_argument("--calls", type=Path, help="also write every traced call (within max(D, 3) hops) here")
    args = ap.parse_args(argv)
    calls = run_traced(max(args.depth, 3), args.eval)
    stays = walk(calls, args.depth)
    print(f"walk of one batch through update_step within {args.depth} hop(s) (grpo, builtin:tiny"
          f"{', held-out evaluation in the step' if args.eval else ''}); ^ = climb back up:")
    for i, s in enumerate(stays):
        print(f"  {i:2d} {'^' if s.climb else ' '} {s.file}  [{', '.join(s.funcs)}]")
    c = counts(stays)
    print(f"D={args.depth}: {c.stays} stays over {c.files} files, {c.moves} moves between files, "
          f"{c.climbs} climbs back up")
    print("by D: " + "; ".join(f"D={d}: {k.stays} stays / {k.files} files / {k.moves} moves / {k.climbs} climbs"
                               for d in range(1, 4) for k in [counts(walk(calls, d))]))
    if args.calls:
        args.calls.write_text(json.dumps([dataclasses.asdict(x) for x in calls]))
    if args.json:
        args.json.write_text(json.dumps({"depth": args.depth, "counts": dataclasses.asdict(c),
                                         "walk": [dataclasses.asdict(s) for s in stays]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

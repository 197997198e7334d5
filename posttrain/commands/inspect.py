"""``posttrain inspect WHAT``: look inside the parts of a run without training anything.

Sub-commands live in :data:`SUBCOMMANDS` (name -> (help, add_arguments, run)); ``inspect task``
prints sample prompts of a task, the model-free reference answer and the verdict that answer
gets from the task's verifier (plus the verdict of a deliberately wrong answer), so a user can
check a task and its verifier agree before spending compute.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from posttrain.commands import inspect_ledger


def _task_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="a task in posttrain.envs TASKS, or 'module.path:factory'")
    p.add_argument("--n", type=int, default=3, help="how many examples to show (default 3)")
    p.add_argument("--split", choices=("train", "heldout"), default="train")
    p.add_argument("--difficulty", type=int, default=None, help="the task's difficulty knob")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra task factory argument (value parsed as JSON if it parses)")


def _parse_kwargs(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in pairs:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise ValueError(f"--kwarg {kv!r} must look like KEY=VALUE")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _wrong_answer(answer: str) -> str:
    # A model-free "wrong" probe: the reference with its last digit changed (or an empty reply).
    for i in range(len(answer) - 1, -1, -1):
        if answer[i].isdigit():
            return answer[:i] + str((int(answer[i]) + 1) % 10) + answer[i + 1 :]
    return ""


def _run_task(args: argparse.Namespace) -> int:
    from posttrain.envs import TASKS
    from posttrain.rewards.verifier import verifier_id

    kwargs = _parse_kwargs(args.kwarg)
    if args.difficulty is not None:
        kwargs["difficulty"] = args.difficulty
    if ":" in args.name:
        from posttrain.dotted import import_dotted

        factory = import_dotted(args.name, what="inspect task")
    else:
        factory = TASKS[args.name]
    task = factory(**kwargs)
    v = task.verifier
    print(f"task {task.name}  split={args.split}  seed={args.seed}  verifier={verifier_id(v)}")
    for ex in task.examples(args.split, args.n, args.seed):
        ans = str(ex.meta.get("answer", ex.reference))
        good = v.verify(ans, ex.reference)
        bad_text = _wrong_answer(ans)
        bad = v.verify(bad_text, ex.reference)
        print(f"- id={ex.prompt_id}")
        print(f"  prompt:    {ex.prompt!r}")
        print(f"  reference: {ans!r}  -> {good.status.value} {dict(good.components)}  ({good.explanation})")
        print(f"  probe:     {bad_text!r}  -> {bad.status.value} {dict(bad.components)}  ({bad.explanation})")
    return 0


# name -> (help, add_arguments(parser), run(args) -> exit code)
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "task": ("sample prompts, reference answers and their verdicts", _task_args, _run_task),
    "ledger": ("a run's trajectories by step: statuses, rewards, lengths, versions",
               inspect_ledger.add_arguments, inspect_ledger.run),
}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``inspect`` and one sub-command per :data:`SUBCOMMANDS` entry."""
    p = sub.add_parser("inspect", help="look at tasks, verifiers and ledgers without training")
    isub = p.add_subparsers(dest="what", metavar="WHAT")
    for name, (help_, add_args, run) in SUBCOMMANDS.items():
        sp = isub.add_parser(name, help=help_)
        add_args(sp)
        sp.set_defaults(func=run)

    def show_help(_: argparse.Namespace) -> int:
        p.print_help()
        return 0

    p.set_defaults(func=show_help)

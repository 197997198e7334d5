"""``posttrain train RECIPE [key=value ...]``: run a recipe (``--print-recipe`` shows its axes).

``trainer`` chooses what trains: an entry of the registry :data:`posttrain.config.trainers.TRAINERS`, whose
program (:func:`posttrain.loop.trainer_program.load_program`) the command runs: ``rl``
(:mod:`posttrain.loop.training_loop`), ``preference`` (:mod:`posttrain.loop.preference_training`, offline pairs
or online groups), ``reward_model`` (:mod:`posttrain.loop.reward_model_training`), ``sft``.

Before anything is written, the program's ``check`` runs (:func:`check_before_run`): for the trainers that
sample, :func:`~posttrain.loop.preflight.preflight` dry-builds one step's parts (task, verifier, reward
weights, advantages with the recipe's KL placement), so a config error the first step would meet is one line
at load; the trainers on a pairs file load and check it instead.

Interrupting a run (Ctrl-C, SIGINT) leaves its last complete checkpoint intact, prints one line saying
how to resume (or that nothing was written), and exits with code 130, also when the ``KeyboardInterrupt``
was swallowed on the way (a finalizer's): the interrupt is a flag (:mod:`posttrain.loop.interrupt`) that
the step loops check between steps and the command checks at the end. A full disk or an unwritable file
in the run directory is one error line naming the path (exit code 2); the checkpoint being written is
discarded, not left half-written.
"""

from __future__ import annotations

import argparse
import errno
import logging
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.config import RECIPES_DIR, RunConfig, dump_config
from posttrain.loop.validate import load_run_config

if TYPE_CHECKING:
    from posttrain.loop.trainer_program import TrainerResult

# Errors of the run directory's storage that the user can fix (free space, permissions).
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
EXIT_INTERRUPTED = 130  # the shell's code for SIGINT (128 + 2)


def recipe_headline(path: Path, width: int = 120) -> str:
    """The first sentence of a recipe's header comment, on one line (at most ``width`` characters).

    Contract: the leading ``#`` lines of the YAML file are joined up to and including the first one
    that ends with ``.`` (or up to an empty comment line); the result is cut with ``...`` beyond
    ``width``; ``""`` when the file has no header comment.
    """
    words: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.lstrip("#").strip()
        if not line.startswith("#") or not text:
            break
        words.append(text)
        if text.endswith("."):
            break
    text = " ".join(words)
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def shipped_recipes_help() -> str:
    """``posttrain train --help``'s epilog: every shipped recipe, one line each, with its headline."""
    paths = sorted(RECIPES_DIR.glob("*.yaml"))
    width = max((len(p.stem) for p in paths), default=0)
    lines = [f"  {p.stem:<{width}}  {recipe_headline(p)}" for p in paths]
    return "shipped recipes (posttrain/recipes/; measured as shipped: docs/algorithms.md):\n" + "\n".join(lines)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("train", help="train with a recipe (YAML path or shipped name) and key=value overrides",
                       epilog=shipped_recipes_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe YAML path or shipped name (listed below)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=3e-4 steps=10; "
                   "resume=true continues the run in run_dir (resume_force=true if the recipe changed)")
    p.add_argument("--print-recipe", action="store_true", help="print the resolved composition and config, then exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def print_recipe(cfg: RunConfig) -> None:
    """The six axes of a trainer that samples (rl, online preference), else the trainer and what it reads;
    then the full resolved YAML."""
    from posttrain.config.trainers import trainer_entry

    entry = trainer_entry(cfg.trainer)
    print(f"recipe {cfg.name}:")
    if entry.samples(cfg):
        for axis, desc in cfg.axes().items():
            print(f"  {axis:<11} {desc}")
    else:  # the six RL axes would describe keys this trainer refuses (docs/trainers.md)
        print(f"  trainer     {entry.name}: {entry.summary}; held-out: {entry.heldout}")
    print("---")
    print(dump_config(cfg), end="")


def resume_command(args: argparse.Namespace) -> str:
    """The command line that resumes this run: the same recipe and overrides with ``resume=true``."""
    keep = [o for o in args.overrides if not o.startswith("resume=")]
    return shlex.join(["posttrain", "train", args.recipe, *keep, "resume=true"])


def _where_to_go_on(cfg: RunConfig | None, args: argparse.Namespace) -> str:
    """``the last checkpoint X is intact; continue with: <resume command>``, or how to start over: with what
    an earlier try left in the run directory (moved to ``failed_<time>/`` by the next fresh run), or, when
    none of the run's files is there (the config never loaded, or the directory was never written), saying
    that nothing was written."""
    from posttrain.learner.checkpoint import latest_checkpoint
    from posttrain.loop.lifecycle import run_dir_of
    from posttrain.loop.run_dir import holds_run_files

    keep = [o for o in args.overrides if not o.startswith("resume=")]
    again = shlex.join(["posttrain", "train", args.recipe, *keep])
    run_dir = None if cfg is None else run_dir_of(cfg)
    if run_dir is None or not holds_run_files(run_dir):
        where = "" if run_dir is None else f" to {run_dir}"
        return f"nothing was written{where}; start again with: {again}"
    ck = latest_checkpoint(run_dir / "checkpoints")
    if ck is None:
        return (f"no checkpoint was written yet; start again with: {again}"
                f" (this run's files are then kept in {run_dir}/failed_<time>/)")
    return f"the last checkpoint {ck} is intact; continue with: {resume_command(args)}"


def print_rise(cfg: RunConfig) -> None:
    """Print the measured held-out rise of the run (greedy, sampled, pass@k: first -> last evaluation)."""
    from posttrain.evaluation.report import heldout_series, rise_lines
    from posttrain.loop.lifecycle import run_dir_of

    for line in rise_lines(heldout_series(run_dir_of(cfg)), cfg.eval.temperature, cfg.eval.sampled_temperature):
        print(f"  {line}")


def check_before_run(cfg: RunConfig) -> None:
    """The checks before the run directory is written: the ``check`` of ``cfg.trainer``'s program
    (:func:`~posttrain.loop.trainer_program.load_program`): the RL preflight for the trainers that sample
    (``rl``, online ``preference``: the task's groups are sampled and verified), the pairs file (fields, rows,
    the split) and the loss's kwargs for the trainers on pairs."""
    from posttrain.loop.trainer_program import load_program

    load_program(cfg.trainer).check(cfg)


def print_closing(cfg: RunConfig, result: TrainerResult) -> None:
    """Print what ``posttrain train`` says when the run ends: the result's summary lines, with the measured
    held-out rise (:func:`print_rise`) after the first (``done: ...``) for a trainer whose entry asks for it
    (:attr:`~posttrain.config.trainers.TrainerEntry.heldout_rise`)."""
    from posttrain.config.trainers import trainer_entry

    first, *rest = result.summary_lines()
    print(first)
    if trainer_entry(cfg.trainer).heldout_rise:
        print_rise(cfg)
    for line in rest:
        print(line)


def run(args: argparse.Namespace) -> int:
    """Train; returns the exit code (0, or 130 after Ctrl-C). Storage errors become ``UserError``.

    Contract: SIGINT is recorded in a flag for the whole command
    (:func:`~posttrain.loop.interrupt.interrupt_flag`, the previous handler restored on return): whatever way
    the run then ends (a ``KeyboardInterrupt``, one a finalizer swallowed, an error after it, or the last
    step), the command prints one line saying what is kept and how to go on, and returns 130.
    """
    from posttrain.loop.interrupt import interrupt_flag, interrupted

    cfg: RunConfig | None = None
    with interrupt_flag():
        try:
            cfg = load_run_config(args.recipe, args.overrides)
            return _run(cfg, args)
        except BaseException as e:
            if not (isinstance(e, KeyboardInterrupt) or interrupted()):
                raise
            print(f"posttrain train: interrupted; {_where_to_go_on(cfg, args)}", file=sys.stderr)
            return EXIT_INTERRUPTED


def _run(cfg: RunConfig, args: argparse.Namespace) -> int:
    """:func:`run` once the config is loaded: the checks, the trainer and its closing lines."""
    from posttrain.loop.interrupt import raise_if_interrupted

    check_before_run(cfg)  # what would fail at step 1 for a config reason fails now, before the run dir exists
    if args.print_recipe:
        print_recipe(cfg)
        return 0
    from posttrain.loop.console import progress_bars
    from posttrain.loop.run_dir import RunDirError, describe_os_error
    from posttrain.loop.trainer_program import load_program

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        with progress_bars(enabled=cfg.logging.progress and not args.no_progress) as progress:
            result = load_program(cfg.trainer).train(cfg, progress)
            raise_if_interrupted()  # an interrupt swallowed after the last step: not "done"
    except OSError as e:
        # The trainer closed the run (lock released); the checkpoints on disk are complete ones.
        if e.errno not in _STORAGE_ERRNOS:
            raise
        where = e.filename or "the run directory"
        raise RunDirError(f"cannot write {where}: {describe_os_error(e)}; {_where_to_go_on(cfg, args)}") from None
    print_closing(cfg, result)
    raise_if_interrupted()
    return 0

"""The ``posttrain`` command line: ``posttrain <command> [args]``.

Each command lives in its own module exposing ``register(subparsers)``, which adds its parser
and sets ``func``. Errors a user can fix (bad config, missing file) are one clear line on stderr
and exit code 2, not a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from posttrain.commands.malloc_preload import apply_malloc_flag
from posttrain.errors import UserError

EXIT_INTERRUPTED = 130  # the shell's code for SIGINT (128 + 2)

# name -> module that implements it (each has register(subparsers)).
COMMANDS: dict[str, str] = {
    "train": "posttrain.commands.train",
    "demo": "posttrain.commands.demo",
    "eval": "posttrain.commands.eval",
    "bench": "posttrain.commands.bench",
    "inspect": "posttrain.commands.inspect",
    "check": "posttrain.commands.check",
    "report": "posttrain.commands.report",
    "compare": "posttrain.commands.compare",
    "view": "posttrain.commands.view",
    "serve": "posttrain.commands.serve",
    "sample": "posttrain.commands.sample",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command registered."""
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Online RL post-training of language models with verifiable rewards.",
        epilog="anywhere on the line: --traceback (the full traceback of an error); --malloc tcmalloc|jemalloc|PATH "
               "(the command under that C allocator, preloaded: a lower learner peak, docs/learner.md)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in COMMANDS.values():
        importlib.import_module(mod).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code (0, 1 for a bug, 2 for a user error, 130
    after Ctrl-C). ``posttrain train`` records SIGINT in a flag while it runs (posttrain/loop/interrupt.py)
    and restores the previous handler before it returns."""
    fresh_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    # --traceback (anywhere on the line) shows the full traceback instead of the one-line error.
    show_tb = "--traceback" in argv
    argv = [a for a in argv if a != "--traceback"]
    # --malloc NAME (anywhere on the line): the command again under that C allocator (commands/malloc_preload.py)
    try:
        argv = apply_malloc_flag(argv, may_exec=fresh_process)
    except UserError as e:
        if show_tb:
            raise
        print(f"posttrain: error: {one_line(e)}", file=sys.stderr)
        return 2
    try:  # the imports of every command take a second or two: Ctrl-C then is one line too
        parser = build_parser()
    except KeyboardInterrupt:
        if show_tb:
            raise
        print("posttrain: interrupted (nothing was written)", file=sys.stderr)
        return _interrupted_exit()
    args, unknown = parser.parse_known_args(argv)
    # key=value overrides may follow flags (`train grpo --no-progress steps=3`): argparse leaves
    # those as unknown; anything else unknown is an error.
    if unknown:
        stray = [u for u in unknown if u.startswith("-") or "=" not in u]
        if stray or not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(stray or unknown)}")
        args.overrides = [*args.overrides, *unknown]
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        code = int(args.func(args) or 0)
        return _interrupted_exit() if code == EXIT_INTERRUPTED else code
    except (UserError, FileNotFoundError, ValueError, KeyError, UnicodeError) as e:
        if show_tb:
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"posttrain {args.command}: error: {one_line(msg)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if show_tb:
            raise
        print(f"posttrain {args.command}: interrupted", file=sys.stderr)
        return _interrupted_exit()
    except Exception as e:  # noqa: BLE001  (SystemExit / KeyboardInterrupt are not Exceptions: not caught here)
        # Not a known user error: still one line (a bug report needs --traceback), exit 1.
        if show_tb:
            raise
        print(f"posttrain {args.command}: error: {type(e).__name__}: {one_line(e)} "
              "(run again with --traceback for details)", file=sys.stderr)
        return 1


def _interrupted_exit() -> int:
    """130, the exit code after Ctrl-C, once CPython has forgotten the interrupt we handled (else a
    ``python -m posttrain.cli`` process could still end by SIGINT, status -2: posttrain/loop/interrupt.py)."""
    from posttrain.loop.interrupt import forget_handled_interrupt

    forget_handled_interrupt()
    return EXIT_INTERRUPTED


def one_line(msg: object) -> str:
    """``str(msg)`` folded onto one line (multi-line library messages joined with ' | ')."""
    parts = [p.strip() for p in str(msg).splitlines() if p.strip()]
    return " | ".join(parts) or "(no message)"


if __name__ == "__main__":
    sys.exit(main())

"""``posttrain sample RECIPE [key=value ...] --k K --prompts N --keep-per-prompt M --out DIR``: rejection sampling
for expert iteration (STaR, Zelikman et al. 2022; RFT, Yuan et al. 2023).

The RL recipe's policy samples ``K`` answers to each of ``N`` of its training prompts with the recipe's engine
(``rollout.engine``: builtin in process, or a vLLM server whose files go under ``DIR``), the run's verifier judges
them, and the correct ones (at most ``M`` per prompt, distinct first) become ``DIR/sft.jsonl`` for
``posttrain train sft sft.data=DIR/sft.jsonl``; every sample and its verdict goes to ``DIR/ledger/``, the counts
to ``DIR/summary.json`` (:mod:`posttrain.loop.rejection_sampling`). An existing non-empty ``DIR`` is refused
unless ``--resume`` (go on with the pass in it: the steps in its ledger are read back, not sampled again; the same
recipe, overrides, engine, ``--k`` and ``--keep-per-prompt``; ``--prompts`` may grow) or ``--force`` (start over).
Ctrl-C stops the engine and ends with exit code 130 and one line naming the command that continues the pass.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from posttrain.commands.train import EXIT_INTERRUPTED


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sample", help="rejection sampling: k answers per training prompt, the verified ones kept "
                                      "as SFT data (expert iteration)")
    p.add_argument("recipe", help="RL recipe YAML path or shipped name (its task, model, verifier, sampling)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. model.path=RUN/checkpoints/step_N/actor")
    p.add_argument("--k", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--prompts", type=int, default=16, help="training prompts to sample (default 16)")
    p.add_argument("--keep-per-prompt", type=int, default=1,
                   help="at most this many correct samples kept per prompt, distinct texts first (default 1)")
    p.add_argument("--out", required=True, help="output directory (ledger/, sft.jsonl, summary.json)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the pass in --out (interrupted, or with more --prompts): the steps in its ledger "
                        "are read back, not sampled again; the same recipe, overrides, --k and --keep-per-prompt")
    p.add_argument("--force", action="store_true", help="start over in an existing non-empty --out")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.set_defaults(func=run)


def check_out_dir(out: Path, force: bool, resume: bool = False) -> None:
    """``ValueError`` when ``out`` exists and is not an empty directory (a file, or a directory holding
    anything) and neither ``force`` nor ``resume`` is set: a second pass must not mix its ledger steps with an
    earlier one's (``resume`` goes on with that pass: :func:`~posttrain.loop.rejection_sampling.resume_point`
    checks it is the same); both set is refused."""
    if force and resume:
        raise ValueError("--resume and --force contradict: --resume goes on with the pass in --out, --force starts over")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not (force or resume):
        raise ValueError(f"--out {out} exists and is not empty; continue its pass with --resume, start over with "
                         "--force, or choose a new directory")


def run(args: argparse.Namespace) -> int:
    """Load the recipe, check ``--out``, sample (or resume), print the summary as JSON; 0, or 130 after Ctrl-C
    with one line naming the ``--resume`` command."""
    from posttrain.loop.rejection_sampling import rejection_sample
    from posttrain.loop.validate import load_run_config

    for flag, v in (("--k", args.k), ("--prompts", args.prompts), ("--keep-per-prompt", args.keep_per_prompt)):
        if v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    out = Path(args.out)
    check_out_dir(out, args.force, args.resume)
    cfg = load_run_config(args.recipe, args.overrides)
    if args.force and out.is_dir():
        import shutil

        # an earlier pass's files (its engine's too); nothing else
        for old in ("ledger", "sft.jsonl", "summary.json", "request.json", "engine_model", "engine_server.log"):
            p = out / old
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["posttrain", "sample", args.recipe, *args.overrides, "--k", str(args.k), "--prompts",
                          str(args.prompts), "--keep-per-prompt", str(args.keep_per_prompt), "--out", str(out)])

    def progress(step: int, steps: int, counts: Mapping[str, int]) -> None:
        if not args.no_progress:
            print(f"posttrain sample: step {step}/{steps}: {counts['samples']} sampled, {counts['correct']} correct, "
                  f"{counts['kept']} kept", file=sys.stderr, flush=True)

    try:
        summary = rejection_sample(cfg, out, k=args.k, prompts=args.prompts, keep_per_prompt=args.keep_per_prompt,
                                   command=command, progress=progress, resume=args.resume)
    except KeyboardInterrupt:
        print(f"posttrain sample: interrupted; the steps in {out / 'ledger'} are kept, continue with: {command} "
              "--resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(json.dumps(summary.as_json(), indent=2))
    if summary.kept:
        print(f"wrote {out / 'sft.jsonl'} ({summary.kept} rows); next: posttrain train sft "
              f"sft.data={out / 'sft.jsonl'} model.path={cfg.model.path}", file=sys.stderr)
    else:
        print(f"nothing kept: no sample of {summary.samples} was correct with a non-blank text; sample a stronger "
              "policy (model.path=RUN/checkpoints/step_N/actor) or raise --k", file=sys.stderr)
    return 0

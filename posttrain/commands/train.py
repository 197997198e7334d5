"""``posttrain train RECIPE [key=value ...]``: run a recipe (``--print-recipe`` shows its axes)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from posttrain.config import dump_config, load_config


def register(sub: Any) -> None:
    p = sub.add_parser("train", help="train with a recipe (YAML path or shipped name) and key=value overrides")
    p.add_argument("recipe", help="recipe YAML path or shipped name (grpo, dapo, dr_grpo, rloo, reinforce_pp, gspo, cispo, ppo)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=3e-4 steps=10")
    p.add_argument("--print-recipe", action="store_true", help="print the resolved composition and config, then exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def print_recipe(cfg: Any) -> None:
    """The six axes, then the full resolved YAML."""
    print(f"recipe {cfg.name}:")
    for axis, desc in cfg.axes().items():
        print(f"  {axis:<11} {desc}")
    print("---")
    print(dump_config(cfg), end="")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.recipe, args.overrides)
    if args.print_recipe:
        print_recipe(cfg)
        return 0
    from posttrain.loop.console import progress_bars
    from posttrain.loop.sync import train

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    with progress_bars(enabled=cfg.logging.progress and not args.no_progress) as progress:
        st = train(cfg, progress=progress)
    curve = ", ".join(f"{s}:{a:.3f}" for s, a, _ in st.heldout_curve)
    print(f"done: {st.step} steps; held-out accuracy by step {curve}")
    if st.stopped:
        print(f"stopped early: {st.stopped}")
    return 0

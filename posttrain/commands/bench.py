"""``posttrain bench NAME``: benchmarks run side by side against a peer, reported as ratios.

Each benchmark is a module with ``add_arguments(parser)`` and ``run(args) -> int``; results go to
stdout and, with ``--json PATH``, to a JSON file. See docs/benchmarks.md for measured figures.
"""

from __future__ import annotations

import argparse
import importlib

# name -> module implementing add_arguments(parser) and run(args)
BENCHMARKS: dict[str, str] = {
    "rollout": "posttrain.bench.rollout",
    "vs-trl": "posttrain.bench.vs_trl",
    "async": "posttrain.bench.async_modes",
    "lora": "posttrain.bench.lora",
    "memory": "posttrain.bench.memory",
    "weight-sync": "posttrain.bench.weight_sync",
}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` and one sub-command per benchmark."""
    p = sub.add_parser("bench", help="run a benchmark against its peer (ratios, JSON output)")
    bsub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, mod in BENCHMARKS.items():
        m = importlib.import_module(mod)
        bp = bsub.add_parser(name, help=(m.__doc__ or "").strip().splitlines()[0])
        bp.add_argument("--json", dest="json_path", default=None, help="also write results to this JSON file")
        m.add_arguments(bp)
        bp.set_defaults(func=m.run)

    def show_help(_: argparse.Namespace) -> int:
        p.print_help()
        return 0

    p.set_defaults(func=show_help)

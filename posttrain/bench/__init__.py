"""Benchmarks behind ``posttrain bench NAME``: each module runs posttrain and its peer side by side.

Every module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and is listed in
``posttrain.commands.bench.BENCHMARKS``. Measured figures live in docs/benchmarks.md.
"""

"""``posttrain view DIR``: a live dashboard of the runs in DIR (or of DIR, a run) in a local web page.

The runs page lists every run with its status and last held-out figure; a run's page shows its
curves (live while it writes), failure symptoms, config and checkpoints; a point on a curve opens
that step's trajectories (steps -> groups -> tokens).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from urllib.parse import quote


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``view`` command."""
    p = sub.add_parser("view", help="a live dashboard of runs (curves, symptoms, trajectories) on 127.0.0.1")
    p.add_argument("run_dir", help="a run directory, or a directory holding runs; runs may still be writing")
    p.add_argument("--port", type=int, default=8765,
                   help="port on 127.0.0.1 (default 8765; 0 picks a free one)")
    p.add_argument("--verifier", default=None,
                   help="evaluation-only second verifier: a registered name (exact, math, ...) or "
                   "module.path:factory")
    p.add_argument("--verifier-kwargs", default=None, help="JSON object of keyword arguments for --verifier")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C); exit code 0."""
    from posttrain.diagnostics.runs import find_runs, run_id
    from posttrain.diagnostics.second_verifier import load_verifier
    from posttrain.diagnostics.viewer_server import PLOT_EXTRA, make_dashboard, plotly_js

    root = Path(args.run_dir)
    runs = find_runs(root)  # one-line FileNotFoundError: no such directory / no run there
    if plotly_js() is None:
        raise ValueError(f"posttrain view draws its curves with plotly, which is not installed: {PLOT_EXTRA}")
    verifier = load_verifier(args.verifier, args.verifier_kwargs) if args.verifier else None
    try:
        server = make_dashboard(root, args.port, verifier)
    except OSError as e:
        raise ValueError(f"cannot listen on 127.0.0.1:{args.port}: {e.strerror} (choose another --port, "
                         "or 0 for a free one)") from None
    port = server.server_address[1]
    url = f"http://127.0.0.1:{port}/"
    if len(runs) == 1:
        url += f"run/{quote(run_id(root, runs[0]), safe='@')}/"
    plural = "s" if len(runs) != 1 else ""
    print(f"posttrain view: {url}  ({len(runs)} run{plural} under {root}; Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0

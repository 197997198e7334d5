"""``posttrain view RUN_DIR``: browse a run's ledger in the browser (steps -> groups -> tokens)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``view`` command."""
    p = sub.add_parser("view", help="browse a run's trajectories in a local web page (127.0.0.1 only)")
    p.add_argument("run_dir", help="a run directory (holding ledger/); may still be writing")
    p.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 (default 8765; 0 picks a free one)")
    p.add_argument("--verifier", default=None,
                   help="evaluation-only second verifier: a registered name (exact, math, ...) or module.path:factory")
    p.add_argument("--verifier-kwargs", default=None, help="JSON object of keyword arguments for --verifier")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C); exit code 0."""
    from posttrain.diagnostics.load import open_ledger
    from posttrain.diagnostics.second_verifier import load_verifier
    from posttrain.diagnostics.viewer_server import make_server

    if not Path(args.run_dir).is_dir():
        raise FileNotFoundError(f"{args.run_dir}: no such run directory")
    open_ledger(args.run_dir)  # one-line error now rather than on the first request
    verifier = load_verifier(args.verifier, args.verifier_kwargs) if args.verifier else None
    try:
        server = make_server(args.run_dir, args.port, verifier)
    except OSError as e:
        raise ValueError(f"cannot listen on 127.0.0.1:{args.port}: {e.strerror}") from None
    port = server.server_address[1]
    print(f"posttrain view: http://127.0.0.1:{port}/  (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0

"""``posttrain serve --tinker``: answer the Tinker API on 127.0.0.1 so the official ``tinker`` SDK and
tinker-cookbook train LoRA adapters on posttrain locally (docs/tinker.md)."""

from __future__ import annotations

import argparse
import signal


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``serve`` command."""
    p = sub.add_parser("serve", help="serve an API other clients drive (--tinker: the Tinker training API)")
    p.add_argument("--tinker", action="store_true", required=True,
                   help="serve the Tinker API (the only service so far; needs the extra posttrain[tinker])")
    p.add_argument("--model", default="builtin:tiny",
                   help="base model: builtin:<preset>, builtin:smollm2-135m-instruct or a local model directory; "
                        "clients name it as base_model")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--state-dir", default="runs/tinker",
                   help="where tinker:// checkpoints are written, in posttrain's checkpoint format (default runs/tinker)")
    p.add_argument("--max-datum-tokens", type=int, default=None,
                   help="refuse a forward_backward datum of more tokens (default 8192: SmolLM2-135M's context, measured "
                        "to peak 1.1 GB above idle; docs/tinker.md, 'Long data are bounded')")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C, SIGINT or SIGTERM); exit code 0."""
    from posttrain.serve.tinker_app import make_server
    from posttrain.serve.wire import proto

    proto()  # the optional extra: a one-line error now rather than on the first request
    try:
        limit = {} if args.max_datum_tokens is None else {"max_datum_tokens": args.max_datum_tokens}
        server = make_server(args.model, port=args.port, host=args.host, state_dir=args.state_dir, **limit)
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    # Stop on SIGINT and SIGTERM even when started with SIGINT ignored (a background job of a
    # non-interactive shell inherits SIG_IGN, and Python then installs no KeyboardInterrupt handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print(f"posttrain serve: Tinker API for {args.model} at {server.url}  "
          f"(TINKER_BASE_URL={server.url} TINKER_API_KEY=tml-local; Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        server.service.close()
    return 0

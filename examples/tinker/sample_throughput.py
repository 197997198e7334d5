"""Throughput of concurrent sample calls against ``posttrain serve --tinker`` (docs/tinker.md).

Starts a server in this process on ``--model``, then for each N sends N ``sample`` calls at once from
one SamplingClient of the official SDK (each: a ``--prompt-len``-token prompt, ``num_samples=4``,
at most ``--max-tokens`` tokens, temperature 1, stopping at EOS) and prints sampled tokens per second. Run on a quiet
machine:  .venv/bin/python examples/tinker/sample_throughput.py --model builtin:smollm2-135m-instruct
"""

import argparse
import os
import tempfile
import time

from posttrain.serve.tinker_app import make_server


def main() -> None:
    """Parse the flags, serve, measure, print one line per N."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated N")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    srv = make_server(args.model, state_dir=tempfile.mkdtemp())
    srv.start()
    os.environ.update(TINKER_BASE_URL=srv.url, TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0")
    import tinker
    from tinker import types

    sc = tinker.ServiceClient()
    sampler = sc.create_sampling_client(base_model=args.model).result()
    prompt = types.ModelInput.from_ints([(7 * i) % 50 + 5 for i in range(args.prompt_len)])
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    sampler.sample(prompt, num_samples=1, sampling_params=params).result()  # warm-up
    for n in (int(x) for x in args.concurrency.split(",")):
        t0 = time.perf_counter()
        futures = [sampler.sample(prompt, num_samples=4, sampling_params=params) for _ in range(n)]
        tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
        dt = time.perf_counter() - t0
        print(f"N={n:3d} calls x 4 samples: {tokens} tokens in {dt:.2f} s = {tokens / dt:.1f} tokens/s", flush=True)
    sc.close("success").result()
    srv.close()


if __name__ == "__main__":
    main()

"""Per-request latency of ``posttrain serve --tinker`` under 1, 4 and 16 concurrent clients (docs/tinker.md).

Starts a server in this process on ``--model``; for each N, N clients (threads, each its own SDK
``ServiceClient`` session with its own LoRA training client and a sampling client of the base model)
run ``--rounds`` rounds of ``forward_backward`` (one cross-entropy datum of ``--tokens`` tokens) ->
``optim_step`` -> ``sample`` (``--prompt-len``-token prompt, 2 samples of at most ``--max-tokens`` tokens),
each call waited for before the next. A request's latency is the time from the SDK call to its result;
one warm-up round per client is not counted. Prints, per N, the median and 95th percentile (nearest
rank) of every kind and of all requests together, the wall time, and the 1-minute load average at the
end (the server runs one worker thread: on a shared machine the load average says how far to trust
the figures)::

    OMP_NUM_THREADS=2 .venv/bin/python examples/tinker/latency.py --model builtin:tiny
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import threading
import time

import torch

from posttrain.serve.tinker_app import make_server

KINDS = ("forward_backward", "optim_step", "sample")


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of ``xs``: the ``ceil(q / 100 * n)``-th smallest (``q`` in (0, 100])."""
    s = sorted(xs)
    return s[max(1, math.ceil(q / 100 * len(s))) - 1]


def client(model: str, rounds: int, tokens: int, prompt_len: int, max_tokens: int, seed: int,
           start: threading.Barrier, out: dict[str, list[float]], lock: threading.Lock) -> None:
    """One client: a session, a training client and a sampler; ``rounds`` timed rounds after one warm-up."""
    import tinker
    from tinker import types

    def td(x: list[int] | list[float], dtype: torch.dtype = torch.float32) -> types.TensorData:
        return types.TensorData.from_torch(torch.tensor(x, dtype=dtype))

    seq = [5 + (seed * 7 + 3 * i) % 90 for i in range(tokens + 1)]
    datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                        loss_fn_inputs={"target_tokens": td(seq[1:], torch.int64), "weights": td([1.0] * tokens)})
    prompt = types.ModelInput.from_ints(seq[:prompt_len])
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=model, rank=8, seed=seed).result(timeout=600)
    sampler = sc.create_sampling_client(base_model=model).result(timeout=600)
    mine: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(rounds + 1):
        if r == 1:
            start.wait(timeout=600)  # every client warmed up: the timed rounds start together
        calls = (lambda: tc.forward_backward([datum], "cross_entropy"),
                 lambda: tc.optim_step(types.AdamParams(learning_rate=1e-4)),
                 lambda: sampler.sample(prompt, num_samples=2, sampling_params=params))
        for kind, call in zip(KINDS, calls, strict=True):
            t0 = time.perf_counter()
            call().result(timeout=600)
            if r > 0:
                mine[kind].append(time.perf_counter() - t0)
    sc.close("success").result(timeout=60)
    with lock:
        for k in KINDS:
            out[k].extend(mine[k])


def main() -> None:
    """Parse the flags, serve, measure, print one block per N."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--clients", default="1,4,16", help="comma-separated numbers of concurrent clients")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per client (after one warm-up round)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the forward_backward datum")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    state = tempfile.mkdtemp()
    srv = make_server(args.model, state_dir=state)
    srv.start()
    os.environ.update(TINKER_BASE_URL=srv.url, TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0")
    print(f"{args.model}: forward_backward of {args.tokens} tokens, optim_step, sample 2 x <= {args.max_tokens} "
          f"tokens; {args.rounds} timed rounds per client; torch threads {torch.get_num_threads()}", flush=True)
    try:
        for n in (int(x) for x in args.clients.split(",")):
            out: dict[str, list[float]] = {k: [] for k in KINDS}
            lock, start = threading.Lock(), threading.Barrier(n)
            threads = [threading.Thread(target=client, args=(args.model, args.rounds, args.tokens, args.prompt_len,
                                                             args.max_tokens, i, start, out, lock)) for i in range(n)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            every = [x for k in KINDS for x in out[k]]
            if len(every) != n * args.rounds * len(KINDS):
                raise SystemExit(f"N={n}: {len(every)} of {n * args.rounds * len(KINDS)} requests answered")
            cols = "  ".join(f"{k} {1e3 * percentile(out[k], 50):.0f}/{1e3 * percentile(out[k], 95):.0f}" for k in KINDS)
            print(f"N={n:2d}: all {1e3 * percentile(every, 50):.0f}/{1e3 * percentile(every, 95):.0f} ms "
                  f"(median/p95; {len(every)} requests)  {cols}  wall {wall:.1f} s  "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        srv.close()
        shutil.rmtree(state)


if __name__ == "__main__":
    main()

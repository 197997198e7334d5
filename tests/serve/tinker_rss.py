"""Measure the server's RSS around one long ``forward_backward`` (docs/tinker.md, "Leaving it running").

Serves ``MODEL`` in-process on 127.0.0.1, sends one cross-entropy ``forward_backward`` of ``TOKENS`` tokens
through the official SDK (LoRA rank 8, all layers) and prints the time and the process's RSS: idle before,
peak (``VmHWM``), right after the result, and 3 s later. Not collected by pytest (a measurement, ~70 s on
SmolLM2-135M at 2000 tokens on 2 cores)::

    OMP_NUM_THREADS=2 .venv/bin/python tests/serve/tinker_rss.py builtin:smollm2-135m-instruct 2000
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import torch


def _status(key: str) -> float:
    """A ``/proc/self/status`` memory line in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def main(model: str, n: int) -> None:
    """Run the measurement and print one line."""
    os.environ.update(TINKER_API_KEY="tml-local", TINKER_TELEMETRY="0")
    from posttrain.serve.tinker_app import make_server

    state = tempfile.mkdtemp()
    srv = make_server(model, port=0, state_dir=state)
    srv.start()
    os.environ["TINKER_BASE_URL"] = srv.url
    import tinker
    from tinker import types

    def td(x: list[int] | list[float], dtype: torch.dtype = torch.float32) -> types.TensorData:
        return types.TensorData.from_torch(torch.tensor(x, dtype=dtype))

    def datum(k: int) -> types.Datum:
        toks = [5 + i % 90 for i in range(k + 1)]
        return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                           loss_fn_inputs={"target_tokens": td(toks[1:], torch.int64), "weights": td([1.0] * k)})

    try:
        sc = tinker.ServiceClient()
        tc = sc.create_lora_training_client(base_model=model, rank=8, seed=0).result(timeout=120)
        tc.forward_backward([datum(16)], "cross_entropy").result(timeout=120)  # warm up
        time.sleep(1)
        idle = _status("VmRSS")
        t0 = time.monotonic()
        tc.forward_backward([datum(n)], "cross_entropy").result(timeout=1200)
        took = time.monotonic() - t0
        peak, after = _status("VmHWM"), _status("VmRSS")
        time.sleep(3)
        print(f"{model} {n} tokens: forward_backward {took:.1f} s; RSS idle {idle:.0f} MB, peak {peak:.0f} MB, "
              f"after {after:.0f} MB, 3 s later {_status('VmRSS'):.0f} MB")
        sc.close("success").result(timeout=60)
    finally:
        srv.close()
        shutil.rmtree(state)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

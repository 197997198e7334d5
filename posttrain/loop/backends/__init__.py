"""Execution backends: ``local`` (in-process, the default) and ``ray`` (actors), one interface.

See :mod:`posttrain.loop.backends.base` for the interface and ``docs/distributed.md`` for the
design. Importing this package never imports Ray; :func:`build_ray_backend` does, and without Ray
installed raises ``ImportError("... pip install 'posttrain[ray]'")``.
"""

from __future__ import annotations

from typing import Any

from posttrain.loop.backends.base import (
    Backend,
    FailedRequest,
    RewardWorkers,
    RolloutInfraError,
    RolloutResult,
    RolloutWorkers,
    check_exactly_once,
)
from posttrain.loop.backends.config import RayBackendConfig
from posttrain.loop.backends.local import LocalRewardWorkers, LocalRolloutWorkers, build_local_backend
from posttrain.loop.backends.recovery import PendingSamples, restore_pending, save_pending

__all__ = [
    "Backend",
    "FailedRequest",
    "LocalRewardWorkers",
    "LocalRolloutWorkers",
    "PendingSamples",
    "RayBackendConfig",
    "RewardWorkers",
    "RolloutInfraError",
    "RolloutResult",
    "RolloutWorkers",
    "build_local_backend",
    "build_ray_backend",
    "builtin_engine_factory",
    "check_exactly_once",
    "restore_pending",
    "save_pending",
]


def build_ray_backend(*args: Any, **kwargs: Any) -> Backend:
    """:func:`posttrain.loop.backends.ray_backend.build_ray_backend` (imports Ray on call)."""
    from posttrain.loop.backends.ray_backend import build_ray_backend as _build

    return _build(*args, **kwargs)


def builtin_engine_factory(*args: Any, **kwargs: Any) -> Any:
    """:func:`posttrain.loop.backends.ray_backend.builtin_engine_factory` (no Ray needed to build it)."""
    from posttrain.loop.backends.ray_backend import builtin_engine_factory as _f

    return _f(*args, **kwargs)

"""The local Tinker server the official-SDK tests drive (tests/serve/): started on 127.0.0.1 with the SDK's
environment pointed at it, closed after the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from posttrain.serve.tinker_app import TinkerServer, make_server


def sdk_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base: str,
               session_timeout_s: float | None = None) -> Iterator[TinkerServer]:
    """Yield a started server on ``base`` (state under ``tmp_path/state``) with ``TINKER_BASE_URL``,
    ``TINKER_API_KEY`` and ``TINKER_TELEMETRY`` set for the SDK; ``session_timeout_s`` overrides the
    service's heartbeat timeout."""
    srv = make_server(base, port=0, state_dir=tmp_path / "state")
    if session_timeout_s is not None:
        srv.service.session_timeout_s = session_timeout_s
    srv.start()
    monkeypatch.setenv("TINKER_BASE_URL", srv.url)
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    try:
        yield srv
    finally:
        srv.close()


def tensor_data(xs: list[int] | list[float], dtype: torch.dtype = torch.float32) -> object:
    """``xs`` as the SDK's ``types.TensorData``."""
    from tinker import types

    return types.TensorData.from_torch(torch.tensor(xs, dtype=dtype))

"""The service without HTTP: a request the SDK's client sends again (same model or sampling session and
seq_id, after a lost reply) gets the first request's id and runs once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.serve.tinker_app import load_base
from posttrain.serve.tinker_service import TinkerService


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[TinkerService]:
    tok, net = load_base("builtin:tiny")
    s = TinkerService("builtin:tiny", net, tok, tmp_path)  # type: ignore[arg-type]
    try:
        yield s
    finally:
        s.close()


def _rid(reply: tuple[int, bytes, str]) -> str:
    status, body, _ = reply
    assert status == 200, body
    return str(json.loads(body)["request_id"])


def test_a_resent_request_runs_once(svc: TinkerService) -> None:
    create = json.dumps({"session_id": "s", "model_seq_id": 0, "base_model": "builtin:tiny",
                         "lora_config": {"rank": 2, "seed": 0}}).encode()
    svc.futures.wait(_rid(svc.create_model(create)), 60)
    step = json.dumps({"model_id": "s:train:0", "seq_id": 1, "adam_params": {"learning_rate": 0.1}}).encode()
    first = _rid(svc.optim_step(step))
    assert _rid(svc.optim_step(step)) == first
    out = svc.futures.wait(first, 60)
    assert out is not None and "metrics" in json.loads(out.body)
    assert svc.hub.get("s:train:0").steps == 1  # one optimizer step, not two

    session = json.dumps({"session_id": "s", "sampling_session_seq_id": 0, "base_model": "builtin:tiny"}).encode()
    sid = json.loads(svc.create_sampling_session(session)[1])["sampling_session_id"]
    sample = json.dumps({"sampling_session_id": sid, "seq_id": 0, "num_samples": 2,
                         "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                         "sampling_params": {"max_tokens": 3, "seed": 1}}).encode()
    a, b = svc.asample(sample), svc.asample(sample)
    assert json.loads(a[1]) == json.loads(b[1])
    assert len(json.loads(a[1])["sample_sequence_ids"]) == 2

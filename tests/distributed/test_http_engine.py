"""The rollout engine behind HTTP: a server subprocess on 127.0.0.1, always killed at the end."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from posttrain.rollout.http_engine import (
    EngineHTTPServer,
    HTTPEngine,
    completion_from_json,
    completion_to_json,
    tiny_builtin_engine,
)
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import GenerationRequest
from posttrain.rollout.weight_transfer import WeightTransferError, pack_state_dict

KW = {"preset": "micro", "seed": 0, "dtype": "float64"}


@pytest.fixture(scope="module")
def server():
    """``(client, process)``; the process is killed at the end whatever happens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "posttrain.rollout.http_engine", "--factory",
         "posttrain.rollout.http_engine:tiny_builtin_engine", "--kwargs", json.dumps(KW),
         "--host", "127.0.0.1", "--port", "0", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line: list[str] = []
        t = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        t.start()
        t.join(120)
        assert line and line[0].startswith("LISTENING "), f"server did not start: {line} rc={proc.poll()}"
        client = HTTPEngine(f"http://127.0.0.1:{int(line[0].split()[1])}", timeout_s=60, weights_timeout_s=60)
        client.wait_ready(30)
        yield client, proc
    finally:
        proc.kill()
        proc.wait(10)


def _requests():
    return [GenerationRequest(f"r{i}", [5, 6, 7 + i], SamplingParams(n=2, max_new_tokens=6, seed=10 + i,
                                                                       temperature=0.9, top_k=20))
            for i in range(3)]


@pytest.mark.timeout(180)
def test_generate_and_update_match_in_process_engine(server):
    client, _proc = server
    local = tiny_builtin_engine(**KW)
    assert client.health()["ok"] and client.version == 0
    assert isinstance(client.version, int)
    remote, ref = client.generate(_requests()), local.generate(_requests())
    assert [(c.request_id, c.sample_index, c.token_ids, c.versions, c.finish_reason) for c in remote] == \
           [(c.request_id, c.sample_index, c.token_ids, c.versions, c.finish_reason) for c in ref]
    for a, b in zip(remote, ref, strict=True):
        assert a.logprobs == b.logprobs  # exact: JSON floats round-trip
        assert a.seed == b.seed and a.params == b.params
    # new weights: both engines move to version 5 with the same tensors
    from posttrain.models import build_tiny_model

    new = build_tiny_model("micro", seed=3, dtype=torch.float64).state_dict()
    client.update_weights(new, 5)
    local.update_weights(new, 5)
    assert client.version == 5
    remote, ref = client.generate(_requests()), local.generate(_requests())
    assert [c.token_ids for c in remote] == [c.token_ids for c in ref]
    assert {v for c in remote for v in c.versions} == {5}


def test_bad_weights_and_bad_requests_fail_loudly(server):
    client, _proc = server
    v = client.version
    packet = pack_state_dict({"model.norm.weight": torch.ones(32, dtype=torch.float64)}, v + 1)
    flipped = packet.buffer.copy()
    flipped[0] ^= 0xFF
    from posttrain.rollout.weight_transfer import WeightPacket

    with pytest.raises(WeightTransferError, match="checksum mismatch"):
        client.send_packet(WeightPacket(packet.version, packet.checksum, packet.manifest, flipped))
    with pytest.raises(WeightTransferError, match="refusing weights"):
        client.update_weights({"model.norm.weight": torch.ones(32, dtype=torch.float64)}, max(0, v - 1) if v else -1)
    assert client.version == v  # nothing was applied
    with pytest.raises(ValueError, match="unknown tensor"):
        client.update_weights({"no.such": torch.ones(2)}, v + 1)
    with pytest.raises(ValueError, match="empty prompt"):
        client.generate([GenerationRequest("bad", [])])


def test_pause_and_resume_over_http(server):
    """Partial rollout through HTTP: finish_target pauses the long sample; resume continues it."""
    client, _proc = server
    reqs = [GenerationRequest("short", [5, 6], SamplingParams(max_new_tokens=2, seed=1)),
            GenerationRequest("long", [5, 7], SamplingParams(max_new_tokens=40, seed=2))]
    out = client.generate(reqs, finish_target=1)
    assert [c.finish_reason for c in out] == ["length", "paused"]
    c = out[1]
    assert 0 < len(c.token_ids) < 40
    resumed = client.generate([GenerationRequest("long", [5, 7], reqs[1].params, resume=c)])[0]
    assert resumed.finished and resumed.token_ids[: len(c.token_ids)] == c.token_ids
    straight = client.generate([reqs[1]])[0]
    assert straight.token_ids == resumed.token_ids  # pause + resume == uninterrupted (same weights)
    client.pause()  # answered even with no generate running


def test_codec_round_trip_with_full_logprobs():
    eng = tiny_builtin_engine(**KW)
    c = eng.generate([GenerationRequest("x", [5], SamplingParams(max_new_tokens=3, top_k=5, seed=2,
                                                                  return_full_logprobs=True))])[0]
    d = completion_from_json(json.loads(json.dumps(completion_to_json(c))))
    assert torch.equal(d.full_logprobs, c.full_logprobs) and d.logprobs == c.logprobs


def test_server_refuses_non_loopback_bind():
    with pytest.raises(ValueError, match="only loopback"):
        EngineHTTPServer(tiny_builtin_engine(**KW), "0.0.0.0", 0)


def test_client_timeout_is_bounded():
    import socket
    import time

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)  # accepts the connection, never answers
    try:
        client = HTTPEngine(f"http://127.0.0.1:{s.getsockname()[1]}", timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer within"):
            client.generate([GenerationRequest("a", [5])])
        assert time.monotonic() - t0 < 5
    finally:
        s.close()

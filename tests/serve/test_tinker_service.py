"""The service without HTTP: a request the SDK's client sends again (same model or sampling session and
seq_id, after a lost reply) gets the first request's id and runs once; an error inside a batched
engine call fails only its request; cancel_future and a session without heartbeats drop queued work."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from posttrain.rollout.sampling import SamplingParams
from posttrain.serve.futures import Job, Outcome
from posttrain.serve.sampling import SampleCall
from posttrain.serve.tinker_app import load_base
from posttrain.serve.tinker_service import TinkerService, return_large_blocks, rss_mb


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


def _blocked(svc: TinkerService) -> threading.Event:
    """Occupy the worker until the returned event is set (so that the test queues jobs behind it)."""
    release, running = threading.Event(), threading.Event()

    def work() -> Outcome:
        running.set()
        release.wait(60)
        return Outcome(b"{}")

    svc.futures.add("block")
    svc.queue.submit(Job("block", work, client="other"))
    assert running.wait(60)
    return release


def _sample_body(prompt: list[int], seq: int) -> bytes:
    return json.dumps({"base_model": "builtin:tiny", "seq_id": seq, "num_samples": 1,
                       "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                       "sampling_params": {"max_tokens": 3, "seed": 1}}).encode()


def _outcome(svc: TinkerService, rid: str) -> dict[str, object] | bytes:
    out = svc.futures.wait(rid, 60)
    assert out is not None
    return json.loads(out.body) if out.content_type == "application/json" else out.body


def test_an_error_inside_a_batched_engine_call_fails_only_its_request(svc: TinkerService) -> None:
    release = _blocked(svc)
    good = [_rid(svc.asample(_sample_body([5 + i, 6, 7], i))) for i in range(3)]
    # a request that passed validation but breaks the engine call (its prompt is outside the vocabulary)
    bad = Job("bad", lambda: svc._sample_batch([bad])[0], batch_key="base", batch_work=svc._sample_batch,
              payload=SampleCall("bad", [1000], SamplingParams(max_new_tokens=3), False))
    svc.futures.add("bad")
    svc.queue.submit(bad)
    release.set()
    assert all(isinstance(_outcome(svc, r), bytes) for r in good)  # protobuf samples
    failed = _outcome(svc, "bad")
    assert isinstance(failed, dict) and failed["category"] == "user" and "outside the vocabulary" in str(failed["error"])
    assert svc.batch_splits == 1


def test_cancel_future_drops_a_queued_request(svc: TinkerService) -> None:
    release = _blocked(svc)
    rid = _rid(svc.asample(_sample_body([5, 6, 7], 0)))
    assert svc.cancel_future(json.dumps({"request_id": rid}).encode())[0] == 200
    got = _outcome(svc, rid)
    assert isinstance(got, dict) and got["category"] == "user" and "cancelled by the client" in str(got["error"])
    assert len(svc.queue) == 0
    release.set()


def test_a_session_without_heartbeats_loses_its_queued_work(svc: TinkerService) -> None:
    svc.session_timeout_s = 0.2
    sid = json.loads(svc.create_session(b"{}")[1])["session_id"]
    svc.futures.wait(_rid(svc.create_model(json.dumps({
        "session_id": sid, "model_seq_id": 0, "base_model": "builtin:tiny", "lora_config": {"rank": 2}}).encode())), 60)
    release = _blocked(svc)
    step = _rid(svc.optim_step(json.dumps({"model_id": f"{sid}:train:0", "seq_id": 1,
                                           "adam_params": {"learning_rate": 0.1}}).encode()))
    time.sleep(0.3)
    assert svc.expire_sessions() == [sid]
    got = _outcome(svc, step)
    assert isinstance(got, dict) and "sent no heartbeat for 0.2 s" in str(got["error"])
    assert svc.heartbeat(json.dumps({"session_id": sid}).encode())[0] == 410  # the SDK stops beating
    release.set()
    assert svc.hub.get(f"{sid}:train:0").steps == 0


def _trim_threshold(bytes_: int) -> None:
    """glibc ``mallopt(M_TRIM_THRESHOLD, bytes_)``: free memory at the top of a heap above this is returned by
    ``free`` itself (default 128 KiB)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    assert libc.mallopt(-1, bytes_)  # M_TRIM_THRESHOLD


@pytest.mark.skipif(rss_mb() is None, reason="reads /proc/self/statm")
def test_memory_a_job_freed_goes_back_to_the_system(svc: TinkerService) -> None:
    """glibc keeps the freed heap of a job (here 300 blocks of 2 MB, allocated after a freed 2 MB block
    raised the mmap threshold, as a long forward_backward's activations do): the worker trims it. A server
    (make_server) fixes the threshold at 1 MB for the whole process, where the blocks would not stay: the
    test sets it above them, as glibc's own raising does. It also raises the trim threshold (glibc's raising
    sets it to twice the mmap threshold): with the default 128 KiB, ``free`` returns the blocks itself whenever
    they happen to end the heap, the worker has nothing to trim, and ``trims`` stayed 0 (stop 49's CI)."""
    assert return_large_blocks(32)
    _trim_threshold(2**31 - 1)

    def heavy() -> Outcome:
        x = torch.ones(2**19)
        del x
        xs = [torch.ones(2**19) for _ in range(300)]
        del xs
        return Outcome(b"{}")

    before = rss_mb()
    assert before is not None
    svc.futures.add("heavy")
    svc.queue.submit(Job("heavy", heavy))
    assert svc.futures.wait("heavy", 60) is not None
    after = rss_mb()
    # 600 MB were allocated and freed: untrimmed they stay resident; halfway between that and 0 leaves room for
    # what other threads of the process allocate meanwhile (a 150 MB bound failed once under a load of 7)
    _trim_threshold(128 * 1024)
    assert return_large_blocks()  # the server's setting, for the tests after this one
    assert after is not None and after - before < 300, (before, after)
    assert svc.trims == 1


def test_a_refused_or_crashed_request_takes_its_seq_id(svc: TinkerService, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at the door (a negative learning rate) or crashed while being prepared (a bug), a training
    request still takes its seq_id: its future fails (user / server category) and the next one runs."""
    svc.futures.wait(_rid(svc.create_model(json.dumps({"session_id": "s", "model_seq_id": 0,
                                                        "base_model": "builtin:tiny", "lora_config": {"rank": 2}}).encode())), 60)

    def step(seq: int, lr: object) -> str:
        return _rid(svc.optim_step(json.dumps({"model_id": "s:train:0", "seq_id": seq,
                                               "adam_params": {"learning_rate": lr}}).encode()))

    refused = _outcome(svc, step(1, -0.1))
    assert isinstance(refused, dict) and refused["category"] == "user" and "learning_rate=-0.1" in str(refused["error"])
    malformed = _outcome(svc, step(2, [1]))  # float([1]): a TypeError, a refusal of a malformed field
    assert isinstance(malformed, dict) and malformed["category"] == "user"

    def bug(step: object) -> None:
        raise RuntimeError("a bug in the server")

    monkeypatch.setattr("posttrain.serve.tinker_service._check_adam", bug)
    crashed = _outcome(svc, step(3, 0.1))
    assert isinstance(crashed, dict) and crashed == {"error": "RuntimeError: a bug in the server", "category": "server"}
    monkeypatch.undo()
    ok = _outcome(svc, step(4, 0.1))
    assert isinstance(ok, dict) and "metrics" in ok and svc.hub.get("s:train:0").steps == 1

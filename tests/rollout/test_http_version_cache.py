"""HTTPEngine.version: the loop reads it every few milliseconds (admission, staleness), so the client keeps
the version the server confirmed for its own weight updates instead of asking each time."""

from __future__ import annotations

import threading

import pytest

from posttrain.rollout.http_engine import EngineHTTPServer, HTTPEngine, tiny_builtin_engine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def served():
    engine = tiny_builtin_engine(preset="micro", seed=0)
    server = EngineHTTPServer(engine)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield engine, HTTPEngine(f"http://127.0.0.1:{server.port}", timeout_s=30, weights_timeout_s=30)
    finally:
        server.shutdown()
        server.server_close()


def test_version_is_asked_once_then_follows_confirmed_updates(served, monkeypatch):
    engine, client = served
    engine.version = 4  # the server holds v4 before this client first asks
    assert client.version == 4
    state = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    client.update_weights(state)  # None: version + 1
    assert engine.version == 5 and client.version == 5
    client.update_weights(state, version=9)
    calls: list[str] = []
    real = client._call
    monkeypatch.setattr(client, "_call", lambda m, path, *a, **k: calls.append(path) or real(m, path, *a, **k))
    assert [client.version for _ in range(20)] == [9] * 20 and engine.version == 9
    assert calls == []  # no round trip per read


def test_a_failed_transfer_makes_the_client_ask_again(served, monkeypatch):
    engine, client = served
    assert client.version == 0
    state = {k: v.detach().clone() for k, v in engine.model.named_parameters()}

    def down(*a, **k):
        raise ConnectionError("server gone")

    real = client._call
    monkeypatch.setattr(client, "_call", down)
    with pytest.raises(ConnectionError):
        client.update_weights(state, version=3)
    monkeypatch.setattr(client, "_call", real)
    engine.version = 2  # whatever the server holds now is what the client reports
    assert client.version == 2

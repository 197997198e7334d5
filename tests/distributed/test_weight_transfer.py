"""Verified weight packets: round trip, tampering, wrong version, dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posttrain.rollout.weight_transfer import (
    WeightPacket,
    WeightTransferError,
    pack_state_dict,
    state_dict_checksum,
)


def _sd():
    g = torch.Generator().manual_seed(0)
    return {"b.w": torch.randn(3, 4, generator=g), "a.bias": torch.randn(5, generator=g, dtype=torch.float64),
            "c.half": torch.randn(2, 2, generator=g).to(torch.bfloat16), "d.idx": torch.arange(4),
            "e.empty": torch.zeros(0, 3)}


def test_round_trip_every_dtype():
    sd = _sd()
    p = pack_state_dict(sd, 7)
    p.verify(version=7, checksum=p.checksum)
    out = p.tensors()
    assert set(out) == set(sd)
    for k, v in sd.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    assert p.nbytes == sum(v.numel() * v.element_size() for v in sd.values())


def test_checksum_is_order_free_but_content_bound():
    sd = _sd()
    assert state_dict_checksum(sd) == state_dict_checksum(dict(reversed(list(sd.items()))))
    sd2 = dict(sd)
    sd2["b.w"] = sd["b.w"].clone()
    sd2["b.w"][0, 0] += 1e-7
    assert state_dict_checksum(sd2) != state_dict_checksum(sd)


def test_tampered_or_stale_packets_are_refused():
    p = pack_state_dict(_sd(), 3)
    flipped = p.buffer.copy()
    flipped[5] ^= 1
    bad = WeightPacket(p.version, p.checksum, p.manifest, flipped)
    with pytest.raises(WeightTransferError, match="worker-x: checksum mismatch"):
        bad.verify(version=3, checksum=p.checksum, where="worker-x")
    with pytest.raises(WeightTransferError, match="version 3, the sender announced 4"):
        p.verify(version=4, checksum=p.checksum)
    with pytest.raises(WeightTransferError, match="checksum mismatch"):
        p.verify(version=3, checksum="0" * 32)
    # a manifest entry renamed (same bytes) changes the checksum too
    renamed = [("z" + m[0],) + tuple(m[1:]) for m in p.manifest]
    with pytest.raises(WeightTransferError):
        WeightPacket(3, p.checksum, renamed, p.buffer).verify(version=3, checksum=p.checksum)


def test_wire_format_truncation():
    p = pack_state_dict(_sd(), 1)
    with pytest.raises(WeightTransferError, match="truncated"):
        WeightPacket.from_wire(p.header(), p.buffer.tobytes()[:-1])
    q = WeightPacket.from_wire(p.header(), p.buffer.tobytes())
    q.verify(version=1, checksum=p.checksum)
    assert np.array_equal(q.buffer, p.buffer)

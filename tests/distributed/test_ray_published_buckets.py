"""RayRanks keeps the published buckets of the latest weight stream only: a stream of the same version again
(ranks restored to an earlier version, then stepped to it once more) starts a new list instead of appending
to the old one (which then failed the driver's check: "published weight buckets [0, 0] ...")."""

from __future__ import annotations

import types

from posttrain.loop.backends.ray_learner import RayRanks
from posttrain.rollout.weight_transfer import PublishedBucket


def test_a_second_stream_of_the_same_version_replaces_the_first() -> None:
    ranks = RayRanks.__new__(RayRanks)  # only the bucket bookkeeping: no Ray, no actors
    ranks._published = []
    ranks._fetch_timeout_s = 1.0
    ranks._ray = types.SimpleNamespace(get=lambda ref, timeout: ref)

    def stream(version: int, n: int) -> None:
        for i in range(n):
            ranks._fetch(PublishedBucket(i, version, f"c{i}", 8, [object()]))

    stream(1, 2)
    assert [b.index for b in ranks.published(1)] == [0, 1]
    stream(2, 1)
    assert [b.index for b in ranks.published(2)] == [0] and ranks.published(1) == []
    stream(3, 2)
    stream(3, 2)  # restored to version 2, stepped to version 3 again: the same version streamed twice
    assert [b.index for b in ranks.published(3)] == [0, 1]

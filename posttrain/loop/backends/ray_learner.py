"""Learner ranks as Ray actors (``system.backend=ray`` with ``learner.strategy=ddp|fsdp2``).

:class:`RayRanks` is a :class:`~posttrain.learner.rank_transport.RankTransport`: the same
:class:`~posttrain.learner.ranks.LearnerRanks` drives it as it drives spawned rank processes. Each
rank is one :class:`RankActor` in a placement group of its own
(:func:`~posttrain.loop.backends.ray_cluster.learner_group`: ``cpus_per_learner`` /
``gpus_per_learner`` / ``learner_resources`` per bundle, PACK or SPREAD). The rank-0 actor reports
its node's address and a free port on it; every actor then runs
:func:`~posttrain.learner.rank_process.rank_main` — the command loop of a spawned rank, unchanged —
on a thread fed by an in-actor pipe, the process group forming at that address (gloo on CPU, NCCL on
GPU, as in the Megatron/torchrun convention the field's Ray launchers follow: veRL, OpenRLHF).

The driver holds one pending ``recv`` call per actor (each returns the next message, or None after
``_RECV_S``); an actor that dies, or whose node dies, fails that call with a Ray error, which ends
the rank: :class:`~posttrain.learner.ranks.LearnerRanks` then kills every rank and raises one line
naming the rank and its node (``rank_timeout_s`` still bounds a silent one). Ray itself is joined or
started with :func:`~posttrain.loop.backends.ray_cluster.init_ray` and left running (the rollout
backend, or the process's exit, shuts it down).

Weights (``system.ray.weight_sync``): with ``direct`` (the default) rank 0's actor takes each weight
bucket its rank streams after an update, ``ray.put`` s the packet (the actor owns the object) and
answers the driver with a :class:`~posttrain.rollout.weight_transfer.PublishedBucket` — a reference
plus the version and the checksum computed when packing. The driver fetches its own copy from the
store (zero-copy on its node) and verifies it as before; the rollout workers get the references
(:meth:`RayRanks.published`, through
:meth:`~posttrain.learner.ranks.LearnerRanks.weights_for_rollout`) and fetch and verify the buckets
themselves. With ``via_driver`` the bucket bytes travel in the recv replies to the driver, which
later packs its copy again for the workers (the path before ``direct``, kept for measurement).
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from posttrain.config.ray import RayBackendConfig
from posttrain.learner.distributed import free_port
from posttrain.learner.rank_process import WeightBucket, rank_main
from posttrain.learner.rank_transport import RankMessage, StartRanks
from posttrain.loop.backends.ray_cluster import infra_errors, init_ray, learner_group, require_ray
from posttrain.rollout.weight_transfer import PublishedBucket, WeightPacket

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

_RECV_S = 0.5  # how long one pending recv call waits in the actor before answering None
# A bucket message's pickle names its status within its first bytes; anything else that does is
# unpickled, checked and passed on unchanged.
_BUCKET_TAG, _TAG_WITHIN = b"bucket", 32
Reply = bytes | tuple[str, PublishedBucket] | None
"""What :meth:`RankActor.recv` answers: a pickled message, a published bucket, or None (nothing yet)."""


def _node_ip() -> str:
    """This Ray node's IP address (the one its raylet registered)."""
    import ray

    return str(ray.get_runtime_context().worker.node_ip_address)


class RankActor:
    """One learner rank in a Ray actor (decorated with ``ray.remote`` by :class:`RayRanks`)."""

    def __init__(self, publish: bool = False) -> None:
        self._conn: Connection | None = None
        self._thread: threading.Thread | None = None
        self._publish = publish  # weight buckets go to the object store (system.ray.weight_sync=direct)

    def node(self) -> tuple[str, str]:
        """``(node IP address, Ray node id)`` of this actor."""
        import ray

        return _node_ip(), str(ray.get_runtime_context().get_node_id())

    def free_port(self) -> int:
        """A free TCP port on this node's address (rank 0's: the process group's rendezvous)."""
        return free_port(_node_ip())

    def start(self, rank: int, world_size: int, host: str, port: int, spec_bytes: bytes, gpu: bool) -> int:
        """Run :func:`rank_main` on a thread (its pipe's other end stays here); returns this process's id.
        ``gpu``: the actor was given one GPU, which it sees as device 0."""
        import multiprocessing as mp

        parent, child = mp.Pipe()

        def serve() -> None:
            try:
                rank_main(rank, world_size, port, child, spec_bytes, host=host, gpu_index=0 if gpu else None,
                          in_thread=True)
            finally:
                child.close()  # the driver's next recv ends with EOFError

        self._conn = parent
        self._thread = threading.Thread(target=serve, name=f"posttrain-learner-rank-{rank}", daemon=True)
        self._thread.start()
        return os.getpid()

    def send(self, payload: bytes) -> None:
        """Hand one command to the rank's loop."""
        assert self._conn is not None, "start first"
        self._conn.send_bytes(payload)

    def recv(self, timeout_s: float) -> Reply:
        """The rank's next message, or None when none came within ``timeout_s``; EOFError once it ended.
        Publishing (module docstring): a weight bucket is put in the object store and answered as
        ``("published", PublishedBucket)``; every other message as its pickled bytes."""
        assert self._conn is not None, "start first"
        if not self._conn.poll(timeout_s):
            return None
        raw = self._conn.recv_bytes()
        if not self._publish or _BUCKET_TAG not in raw[:_TAG_WITHIN]:
            return raw
        status, bucket = pickle.loads(raw)
        if status != "bucket" or not isinstance(bucket, WeightBucket):
            return raw
        import ray

        ref: ObjectRef[WeightPacket] = ray.put(bucket.packet)
        return "published", PublishedBucket(bucket.index, bucket.version, bucket.checksum, bucket.packet.nbytes, [ref])


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return " ".join(text.split())[:300]


class RayRanks:
    """``world_size`` :class:`RankActor` s placed by Ray; see the module docstring. ``gpu``: the ranks
    use CUDA (then ``gpus_per_learner`` must give each one a GPU)."""

    def __init__(self, world_size: int, spec_bytes: bytes, cfg: RayBackendConfig, *, gpu: bool = False) -> None:
        ray = require_ray()
        from ray.util import remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if gpu and cfg.gpus_per_learner < 1:
            raise ValueError(f"CUDA learner ranks on Ray need system.ray.gpus_per_learner >= 1 (one GPU per rank), "
                             f"got {cfg.gpus_per_learner:g}")
        self.world_size = world_size
        self._ray = ray
        init_ray(cfg)
        self._pg = learner_group(cfg, world_size)
        self.actors: list[ActorHandle[RankActor]] = []
        self._inbox: dict[int, list[RankMessage]] = {r: [] for r in range(world_size)}
        self._dead: dict[int, str] = {}
        self._recv: dict[int, ObjectRef[Reply]] = {}
        self._published: list[PublishedBucket] = []  # the latest version's, in arrival (= bucket) order
        self._fetch_timeout_s = cfg.transfer_timeout_s
        publish = cfg.weight_sync == "direct"
        self._where: dict[int, str] = {}
        try:
            cls = ray.remote(RankActor)
            for r in range(world_size):
                self.actors.append(cls.options(
                    num_cpus=cfg.cpus_per_learner, num_gpus=cfg.gpus_per_learner, max_concurrency=3, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                                         placement_group_bundle_index=r),
                ).remote(publish and r == 0))  # rank 0 streams the buckets
            t = cfg.startup_timeout_s
            nodes = ray.get([a.node.remote() for a in self.actors], timeout=t)
            self._where = {r: f"node {nid[:12]} ({ip})" for r, (ip, nid) in enumerate(nodes)}
            host = nodes[0][0]
            port = ray.get(self.actors[0].free_port.remote(), timeout=t)
            ray.get([a.start.remote(r, world_size, host, port, spec_bytes, gpu) for r, a in enumerate(self.actors)],
                    timeout=t)
            for r in range(world_size):
                self._recv[r] = self.actors[r].recv.remote(_RECV_S)
        except BaseException:
            self._kill()
            remove_placement_group(self._pg)
            raise

    # ------------------------------------------------------------------ RankTransport
    def send(self, rank: int, payload: bytes) -> None:
        """See :meth:`~posttrain.learner.rank_transport.RankTransport.send` (waits for the actor's ack,
        so commands arrive in order); a dead actor raises ``OSError``."""
        if rank in self._dead:
            raise OSError(self._dead[rank])
        try:
            self._ray.get(self.actors[rank].send.remote(payload))
        except (*infra_errors(), self._ray.exceptions.RayTaskError) as e:
            self._dead.setdefault(rank, _one_line(e))
            raise OSError(self._dead[rank]) from e

    def _take(self, rank: int) -> None:
        """Resolve rank's finished recv call: a message to the inbox, or the rank's end; then re-arm."""
        ref = self._recv.pop(rank)
        try:
            msg = self._ray.get(ref)
            if isinstance(msg, bytes):
                self._inbox[rank].append(pickle.loads(msg))
            elif msg is not None:
                self._inbox[rank].append(self._fetch(msg[1]))
        except self._ray.exceptions.RayTaskError as e:  # EOFError in the actor: the rank's loop ended
            self._dead[rank] = f"its command loop ended ({type(e.cause).__name__ if e.cause else 'error'})"
            return
        except (*infra_errors(), self._ray.exceptions.GetTimeoutError) as e:  # a bucket's fetch included
            self._dead[rank] = _one_line(e)
            return
        self._recv[rank] = self.actors[rank].recv.remote(_RECV_S)

    def _fetch(self, bucket: PublishedBucket) -> RankMessage:
        """A published bucket as the bucket message the driver copy loads (its packet fetched from the
        store: zero-copy on this node); the reference is kept for :meth:`published`."""
        if self._published and (self._published[0].version != bucket.version or bucket.index == 0):
            self._published = []  # a new stream: a new version, or the same version again (a restore to it)
        self._published.append(bucket)
        packet: WeightPacket = self._ray.get(bucket.box[0], timeout=self._fetch_timeout_s)
        return "bucket", WeightBucket(bucket.index, packet, bucket.checksum, bucket.version)

    def ready(self, ranks: Sequence[int], timeout_s: float) -> list[int]:
        """See :meth:`~posttrain.learner.rank_transport.RankTransport.ready` (``ray.wait`` over the
        pending recv calls)."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            out = [r for r in ranks if self._inbox[r] or r in self._dead]
            if out:
                return out
            waiting = {self._recv[r]: r for r in ranks if r in self._recv}
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return []
            done, _ = self._ray.wait(list(waiting), num_returns=1, timeout=left)
            if done:
                done, _ = self._ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
            for ref in done:
                self._take(waiting[ref])

    def recv(self, rank: int) -> RankMessage:
        """See :meth:`~posttrain.learner.rank_transport.RankTransport.recv`."""
        if self._inbox[rank]:
            return self._inbox[rank].pop(0)
        raise EOFError(self._dead.get(rank, "no message"))

    def published(self, version: int) -> list[PublishedBucket]:
        """See :meth:`~posttrain.learner.rank_transport.RankTransport.published`: rank 0's buckets of
        ``version`` in the object store (``system.ray.weight_sync=direct``; else none)."""
        return [b for b in self._published if b.version == version]

    def exit_reason(self, rank: int) -> str | None:
        """See :meth:`~posttrain.learner.rank_transport.RankTransport.exit_reason` (the Ray error that
        ended the actor, in one line)."""
        return self._dead.get(rank)

    def where(self) -> Mapping[int, str]:
        """``{rank: "node <Ray node id prefix> (<ip>)"}``."""
        return dict(self._where)

    def _kill(self) -> None:
        for a in self.actors:
            try:
                self._ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001,S110 - already gone
                pass
        self.actors = []

    def close(self, grace_s: float) -> None:
        """See :meth:`~posttrain.learner.rank_transport.RankTransport.close`: waits up to ``grace_s``
        for the ranks' loops to end (their recv calls end), then kills the actors and releases the
        placement group."""
        from ray.util import remove_placement_group

        if not self.actors:
            return
        if grace_s > 0 and self._recv:
            self._ray.wait(list(self._recv.values()), num_returns=len(self._recv), timeout=grace_s)
        self._kill()
        self._recv = {}
        self._published = []
        try:
            remove_placement_group(self._pg)
        except Exception:  # noqa: BLE001,S110 - best effort at shutdown
            pass


def ray_rank_starter(cfg: RayBackendConfig, *, gpu: bool = False) -> StartRanks:
    """The ``start_ranks`` argument of :class:`~posttrain.learner.ranks.LearnerRanks` that places the
    ranks as Ray actors (``system.ray`` settings ``cfg``)."""

    def start(world_size: int, spec_bytes: bytes) -> RayRanks:
        return RayRanks(world_size, spec_bytes, cfg, gpu=gpu)

    return start


__all__ = ["RankActor", "RayRanks", "ray_rank_starter"]

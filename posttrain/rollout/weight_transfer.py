"""Verified weight transfer: a state dict packed into ONE flat byte buffer plus a manifest.

A :class:`WeightPacket` is what travels from the learner to a rollout engine in another process
(Ray object store, HTTP body). It holds

- ``buffer``: every tensor's raw bytes, concatenated (a 1-D ``uint8`` numpy array, so Ray's
  object store hands it to every reader zero-copy, and an HTTP body is just these bytes);
- ``manifest``: ``(name, dtype, shape, offset, nbytes)`` per tensor, in a fixed (sorted) order;
- ``version``: the learner version the weights belong to;
- ``checksum``: ``blake2b-128`` over the manifest (as canonical JSON) and the buffer.

The receiver recomputes the checksum and compares it, and the version, with the values the
sender announced *separately* (the call that asks it to load the packet), so a corrupted, truncated,
swapped or stale payload is refused with :class:`WeightTransferError` before any parameter is
touched. One flat buffer is also the shape a GPU path wants: it is a single tensor for a
``torch.distributed.broadcast`` over NCCL (see ``docs/distributed.md``).

A :class:`PublishedBucket` is a packet left in a shared store (Ray's object store) by the process
that packed it: readers get only a reference plus the version and checksum announced beside it, and
fetch and verify the bytes themselves. :class:`PublishedWeights` is a state dict together with the
published buckets that hold exactly its tensors, so an engine that can reach the store loads those
instead of packing the state dict again (``system.ray.weight_sync=direct``, docs/distributed.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ray import ObjectRef

ManifestEntry = tuple[str, str, tuple[int, ...], int, int]


class WeightTransferError(RuntimeError):
    """A weight transfer failed verification (checksum, version, names) or timed out."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise WeightTransferError(f"unknown tensor dtype {name!r} in a weight manifest")
    return dt


def _digest(manifest: list[ManifestEntry], buffer: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps([list(m[:2]) + [list(m[2])] + list(m[3:]) for m in manifest]).encode())
    h.update(np.ascontiguousarray(buffer).view(np.uint8).data)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class WeightPacket:
    """A packed state dict (see the module docstring). Build with :func:`pack_state_dict`."""

    version: int
    checksum: str
    manifest: list[ManifestEntry]
    buffer: np.ndarray

    @property
    def nbytes(self) -> int:
        """Payload size in bytes."""
        return int(self.buffer.nbytes)

    def verify(self, *, version: int, checksum: str, where: str = "receiver") -> None:
        """Raise :class:`WeightTransferError` unless version and recomputed checksum match the announced ones."""
        if self.version != version:
            raise WeightTransferError(
                f"{where}: weight packet carries version {self.version}, the sender announced {version}"
            )
        actual = _digest(self.manifest, self.buffer)
        if actual != self.checksum or actual != checksum:
            raise WeightTransferError(
                f"{where}: checksum mismatch for weights v{version}: received bytes hash to {actual}, "
                f"packet says {self.checksum}, sender announced {checksum}"
            )

    def tensors(self, *, read_only_views: bool = False) -> dict[str, torch.Tensor]:
        """Unpack into ``{name: tensor}`` (CPU; each a view on the buffer when it is writable, else on a
        copy of it). ``read_only_views``: views on a read-only buffer too (one fetched from Ray's
        object store, shared with its other readers), for a caller that only reads them — copies them
        into its own tensors — and saves the copy of the whole buffer; writing into them is undefined."""
        raw = self.buffer
        if not raw.flags.writeable and not read_only_views:
            raw = raw.copy()
        with warnings.catch_warnings():  # torch warns on every view of a read-only buffer
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            return self._views(raw)

    def _views(self, raw: np.ndarray) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, dtype, shape, offset, nbytes in self.manifest:
            if offset < 0 or offset + nbytes > raw.nbytes:
                raise WeightTransferError(f"tensor {name!r}: bytes [{offset}, {offset + nbytes}) outside the buffer")
            dt = _dtype_of(dtype)
            if nbytes == 0:
                out[name] = torch.empty(shape, dtype=dt)
                continue
            t = torch.frombuffer(raw, dtype=dt, count=nbytes // torch.empty((), dtype=dt).element_size(), offset=offset)
            out[name] = t.view(shape)
        return out

    # ------------------------------------------------------------------ wire format (HTTP)
    def header(self) -> dict[str, Any]:
        """JSON-able header (everything but the buffer)."""
        return {
            "version": self.version,
            "checksum": self.checksum,
            "manifest": [[n, d, list(s), o, b] for n, d, s, o, b in self.manifest],
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_wire(cls, header: Mapping[str, Any], body: bytes | bytearray | memoryview) -> WeightPacket:
        """Inverse of :meth:`header` + raw buffer bytes (no verification: call :meth:`verify`)."""
        buf = np.frombuffer(body, dtype=np.uint8)
        if buf.nbytes != int(header["nbytes"]):
            raise WeightTransferError(f"weight payload truncated: {buf.nbytes} of {header['nbytes']} bytes")
        manifest = [(str(n), str(d), tuple(int(x) for x in s), int(o), int(b)) for n, d, s, o, b in header["manifest"]]
        return cls(int(header["version"]), str(header["checksum"]), manifest, buf)


def pack_state_dict(state_dict: Mapping[str, torch.Tensor], version: int) -> WeightPacket:
    """Copy ``state_dict`` (any device, any dtype) into one flat CPU buffer and checksum it.

    Tensors are taken in sorted name order; tied weights appear under each name given.
    """
    items = sorted(state_dict.items())
    total = 0
    manifest: list[ManifestEntry] = []
    for name, t in items:
        nb = t.numel() * t.element_size()
        manifest.append((name, _dtype_name(t.dtype), tuple(int(x) for x in t.shape), total, nb))
        total += nb
    buffer = np.empty(total, dtype=np.uint8)
    flat = torch.from_numpy(buffer)
    for (_name, _d, _s, off, nb), (_n, t) in zip(manifest, items, strict=True):
        if nb:
            src = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            flat[off : off + nb].copy_(src)
    return WeightPacket(int(version), _digest(manifest, buffer), manifest, buffer)


def state_dict_checksum(state_dict: Mapping[str, torch.Tensor]) -> str:
    """The checksum :func:`pack_state_dict` would give ``state_dict`` (any version)."""
    return pack_state_dict(state_dict, 0).checksum


@dataclasses.dataclass(frozen=True)
class PublishedBucket:
    """One :class:`WeightPacket` in a shared store, as its readers see it (module docstring).

    ``box``: a one-element list holding the store reference (inside a list, Ray hands the reference
    itself to an actor instead of resolving it); ``checksum`` and ``version`` are the values the
    packer computed beside the packet, against which every reader verifies the bytes it fetched.
    """

    index: int
    version: int
    checksum: str
    nbytes: int
    box: list[ObjectRef[WeightPacket]]


class PublishedWeights(Mapping[str, torch.Tensor]):
    """``state_dict`` (read as a plain mapping) plus the published ``buckets`` that hold exactly its
    tensors at ``version``; the holder guarantees the two agree (module docstring)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], version: int,
                 buckets: Sequence[PublishedBucket]) -> None:
        if not buckets or any(b.version != version for b in buckets):
            raise ValueError(f"published weights v{version} need buckets of that version, got "
                             f"{[b.version for b in buckets]}")
        self._sd = state_dict
        self.version = int(version)
        self.buckets: tuple[PublishedBucket, ...] = tuple(buckets)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._sd[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sd)

    def __len__(self) -> int:
        return len(self._sd)


def buckets_identity(checksums: Sequence[str]) -> str:
    """One identity for weights sent as ``checksums`` (one per bucket, in order): the checksum itself
    for a single packet, else blake2b-128 over the checksums."""
    if len(checksums) == 1:
        return checksums[0]
    h = hashlib.blake2b(digest_size=16)
    for c in checksums:
        h.update(c.encode())
    return h.hexdigest()

"""The Tinker API's protobuf messages <-> plain Python: the schema is the SDK's own
(``tinker/proto/tinker_public_pb2.py`` of the optional ``tinker`` package, extra ``posttrain[tinker]``).

Only what this server implements is decoded: token chunks (``encoded_text``) and dense 1-D
``loss_fn_inputs``. Image / audio chunks and sparse tensors are :class:`~posttrain.errors.UserError` s
naming the datum (a :class:`RefusedRequest`, which carries the model and ``seq_id`` so that the
refusal takes its place in the model's order), as are non-finite float inputs. Provenance spans (where a datum's tokens were sampled; tinker-cookbook sends them)
are accepted and not used: they serve losses this server does not implement (``stable_reinforce``)
and change nothing in the ones it does.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import numpy as np
import torch

from posttrain.errors import UserError


def proto() -> ModuleType:
    """The SDK's generated protobuf module; ``UserError`` saying how to install it when absent."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as e:
        raise UserError("posttrain serve --tinker needs the optional extra: pip install 'posttrain[tinker]'") from e
    return tinker_public_pb2


class RefusedRequest(UserError):
    """A request whose model and ``seq_id`` are known but whose content is refused: the service queues it
    as a failing job at that ``seq_id`` instead of answering 400 (the model's later requests then run)."""

    def __init__(self, message: str, model_id: str, seq_id: int) -> None:
        super().__init__(message)
        self.model_id = model_id
        self.seq_id = seq_id


@dataclasses.dataclass(frozen=True)
class DatumIn:
    """One training example: ``tokens [N]`` (the model input) and ``inputs`` (``loss_fn_inputs``, each ``[N]``)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ForwardBackwardIn:
    """A decoded ``/forward_backward`` request."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[DatumIn]


_NP: dict[int, np.dtype[np.float32 | np.int64 | np.int32]] = {
    1: np.dtype(np.float32), 2: np.dtype(np.int64), 3: np.dtype(np.int32)}


def _tensor(msg: object, where: str) -> torch.Tensor:
    pb = proto()
    if msg.WhichOneof("encoding") != "dense":  # type: ignore[attr-defined]
        raise UserError(f"{where}: sparse tensors are not supported by posttrain serve")
    dtype = _NP.get(int(msg.dtype))  # type: ignore[attr-defined]
    if dtype is None or msg.dtype == pb.DTYPE_BFLOAT16:  # type: ignore[attr-defined]
        raise UserError(f"{where}: tensor dtype {msg.dtype} is not supported")  # type: ignore[attr-defined]
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()  # type: ignore[attr-defined]
    shape = list(msg.shape)  # type: ignore[attr-defined]
    if shape and (len(shape) != 1 or shape[0] != arr.size):
        raise UserError(f"{where}: shape {shape}; posttrain serve takes 1-D loss_fn_inputs")
    t = torch.from_numpy(arr)
    if dtype == np.dtype(np.float32) and not bool(torch.isfinite(t).all()):
        raise UserError(f"{where}: holds NaN or infinite values")
    return t.to(torch.int64) if dtype != np.dtype(np.float32) else t


def tokens_of_chunks(chunks: list[object], where: str) -> list[int]:
    """The token ids of a protobuf model input (``encoded_text`` chunks only)."""
    out: list[int] = []
    for c in chunks:
        kind = c.WhichOneof("chunk")  # type: ignore[attr-defined]
        if kind != "encoded_text":
            raise UserError(f"{where}: {kind} chunks are not supported by posttrain serve (token chunks only)")
        out += np.frombuffer(c.encoded_text.tokens, dtype=np.int32).tolist()  # type: ignore[attr-defined]
    return out


def decode_forward_backward(body: bytes) -> ForwardBackwardIn:
    """Parse a ``ForwardBackwardRequest``; ``UserError`` for an unparsable message, :class:`RefusedRequest`
    for content this server does not take (its model and ``seq_id`` parsed)."""
    from google.protobuf.message import DecodeError

    msg = proto().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise UserError(f"forward_backward: the body is not a ForwardBackwardRequest: {e}") from None
    route = "forward" if msg.forward_only else "forward_backward"
    try:
        config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
        for k, v in msg.loss_fn_config_v2.items():
            config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
        data: list[DatumIn] = []
        for i, d in enumerate(msg.data):
            tokens = tokens_of_chunks(list(d.model_input), f"{route} datum {i}")
            inputs = {k: _tensor(v, f"{route} datum {i} loss_fn_inputs[{k!r}]") for k, v in d.loss_fn_inputs.items()}
            if "target_tokens" not in inputs:
                raise UserError(f"{route} datum {i}: loss_fn_inputs has no 'target_tokens'")
            data.append(DatumIn(tokens, inputs))
        if not data:
            raise UserError(f"{route}: no data")
    except UserError as e:
        raise RefusedRequest(str(e), msg.model_id, int(msg.seq_id)) from None
    return ForwardBackwardIn(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def encode_forward_backward(logprobs: list[torch.Tensor], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: one ``ArrayRecord`` holding ``logprobs`` (float32) per datum."""
    pb = proto()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    rec = out.loss_fn_outputs.add()
    rec.type_tag = "ArrayRecord"
    rec.num_datums = len(logprobs)
    field = rec.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    arrays = [lp.detach().to(torch.float32).numpy() for lp in logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = offsets.tobytes()
    return bytes(out.SerializeToString())


@dataclasses.dataclass(frozen=True)
class SequenceOut:
    """One sampled sequence: tokens, their log-probs, and whether it stopped (else hit the length)."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool


def encode_sample(sequences: list[SequenceOut], prompt_logprobs: list[float] | None) -> bytes:
    """A ``SampleResponse`` (``prompt_logprobs``: NaN where there is none, e.g. position 0)."""
    pb = proto()
    out = pb.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return bytes(out.SerializeToString())

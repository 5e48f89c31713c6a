"""Wire format of the batch stream: one msgspec header frame + raw array frames. Never pickle.

    trainer rank (DEALER)                         orchestrator (ROUTER)
      [Request(step, rank, world_size)]   ───►
                                          ◄───  [BatchHeader] [arr] [arr] ...   (one rank's slice)
                                          ◄───  [ErrorReply]                     (e.g. step evicted)

A batch message for rank r holds, for each of its micro-batches in order, one frame per array of
`ARRAY_NAMES` (so `6 * num_micro_batches` array frames), then `routed_experts` when `routes_width` > 0
and `teacher_logprobs` when `teacher_kl_weight` > 0. Each frame is the raw little-endian bytes of a
flat array; `BatchHeader.arrays` says its name, dtype and length. After every array frame come the rows'
images, one frame each (the encoded image file), in the order of `BatchHeader.images`.

Invariants (checked by `decode_*`, which raise `WireError`, never skip):
- the first frame decodes to a known message type (tagged msgspec union);
- frame count, names, dtypes and byte sizes match the header; no frame exceeds `max_frame_bytes`;
- every array of a micro-batch has the micro-batch's length from `layout[rank]`;
- temperature is finite and > 0, `num_loss_tokens` >= this rank's loss tokens;
- every image lies inside its micro-batch, in token order, its frame `nbytes` long.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from prime_async.transport.types import ARRAY_DTYPES, ROUTES_DTYPE, MicroBatch, RowImage, TrainBatch

ARRAY_NAMES: tuple[str, ...] = tuple(ARRAY_DTYPES)
PROTOCOL_VERSION = 5  # 2: branches; 3: routed experts; 4: teacher logprobs; 5: rows' images
ROUTES = "routed_experts"
TEACHER = "teacher_logprobs"
TEACHER_DTYPE = np.dtype(np.float32)


class WireError(RuntimeError):
    """A message on the batch stream is malformed, unexpected or inconsistent with its header (a peer
    failure, hence RuntimeError: the trainer exits with a traceback, not as a config error)."""


class ArraySpec(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    length: int


class ImageSpec(msgspec.Struct, frozen=True):
    """One image of this rank's micro-batch `micro_batch` (`RowImage` without its bytes)."""

    micro_batch: int
    offset: int
    length: int
    grid_thw: tuple[int, int, int]
    nbytes: int


class Request(msgspec.Struct, tag="request", frozen=True):
    """Trainer rank -> orchestrator: 'send me batch `step`'. The first one is the READY handshake."""

    step: int
    rank: int
    world_size: int
    protocol: int = PROTOCOL_VERSION


class BatchHeader(msgspec.Struct, tag="batch", frozen=True):
    """Orchestrator -> trainer rank: header of rank `rank`'s slice of batch `step`."""

    step: int
    rank: int
    world_size: int
    layout: list[list[int]]  # tokens of each micro-batch, per rank (the whole batch's layout)
    arrays: list[ArraySpec]  # this rank's array frames, in frame order
    num_loss_tokens: int  # loss tokens of the whole batch (all ranks): the loss normalizer
    temperature: float
    min_dispatch_version: int
    metrics: dict[str, float] = {}
    protocol: int = PROTOCOL_VERSION
    max_dispatch_version: int = -1  # newest group's; -1 = not reported (older senders)
    routes_width: int = 0  # > 0: every micro-batch has a `routed_experts` frame of (length, routes_width)
    teacher_kl_weight: float = 0.0  # > 0: every micro-batch has a `teacher_logprobs` frame (after routes)
    images: list[ImageSpec] = []  # the rows' images, one frame each after all array frames


class ErrorReply(msgspec.Struct, tag="error", frozen=True):
    """Orchestrator -> trainer rank: the request cannot be served (the trainer must fail loudly)."""

    step: int
    message: str


Message = Request | BatchHeader | ErrorReply
_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


def encode_message(msg: Request | ErrorReply) -> bytes:
    return _encoder.encode(msg)


def decode_message(frame: bytes | memoryview) -> Message:
    """Decode a header frame into a known message type, or raise `WireError`."""
    try:
        msg = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"undecodable or unknown message on the batch stream: {exc}") from exc
    if isinstance(msg, Request | BatchHeader) and msg.protocol != PROTOCOL_VERSION:
        raise WireError(f"peer speaks protocol version {msg.protocol}, this side {PROTOCOL_VERSION}")
    return msg


def encode_rank_slice(batch: TrainBatch, rank: int) -> list[bytes | memoryview]:
    """Header + raw array frames of `rank`'s micro-batches. Array frames reference the arrays (no copy)."""
    world_size = len(batch.micro_batches)
    arrays: list[ArraySpec] = []
    frames: list[bytes | memoryview] = []
    width = routes_width(batch)
    for mb in batch.micro_batches[rank]:
        for name in ARRAY_NAMES:
            arr = np.ascontiguousarray(getattr(mb, name), dtype=ARRAY_DTYPES[name])
            if arr.ndim != 1:
                raise WireError(f"micro-batch array {name} must be 1-D, got shape {arr.shape}")
            arrays.append(ArraySpec(name=name, dtype=arr.dtype.str, length=int(arr.shape[0])))
            frames.append(memoryview(arr).cast("B"))
        if width:
            routes = mb.routes_or_unknown(width)
            if routes.shape != (mb.num_tokens, width):
                raise WireError(f"routed_experts {routes.shape} != ({mb.num_tokens}, {width})")
            arrays.append(ArraySpec(name=ROUTES, dtype=routes.dtype.str, length=int(routes.size)))
            frames.append(memoryview(routes.reshape(-1)).cast("B"))
        if batch.teacher_kl_weight > 0:
            teacher = mb.teacher_or_zeros()
            if teacher.shape != (mb.num_tokens,):
                raise WireError(f"teacher_logprobs {teacher.shape} != ({mb.num_tokens},)")
            arrays.append(ArraySpec(name=TEACHER, dtype=teacher.dtype.str, length=int(teacher.size)))
            frames.append(memoryview(teacher).cast("B"))
    images = [
        ImageSpec(
            micro_batch=i, offset=im.offset, length=im.length, grid_thw=im.grid_thw, nbytes=len(im.data)
        )
        for i, mb in enumerate(batch.micro_batches[rank])
        for im in mb.images
    ]
    frames.extend(im.data for mb in batch.micro_batches[rank] for im in mb.images)
    header = BatchHeader(
        images=images,
        step=batch.step,
        rank=rank,
        world_size=world_size,
        layout=[[mb.num_tokens for mb in mbs] for mbs in batch.micro_batches],
        arrays=arrays,
        num_loss_tokens=batch.num_loss_tokens,
        temperature=batch.temperature,
        min_dispatch_version=batch.min_dispatch_version,
        max_dispatch_version=batch.max_dispatch_version,
        metrics=dict(batch.metrics),
        routes_width=width,
        teacher_kl_weight=batch.teacher_kl_weight,
    )
    return [_encoder.encode(header), *frames]


def routes_width(batch: TrainBatch) -> int:
    """Experts per token (layers * k) of the batch's routed experts; 0 when it carries none."""
    widths = {
        int(mb.routed_experts.shape[1])
        for mbs in batch.micro_batches
        for mb in mbs
        if mb.routed_experts is not None
    }
    if len(widths) > 1:
        raise WireError(f"batch {batch.step}: routed_experts of different widths {sorted(widths)}")
    return widths.pop() if widths else 0


def _frame_names(header: BatchHeader) -> tuple[str, ...]:
    """The array frames of one micro-batch, in order."""
    return (
        ARRAY_NAMES
        + ((ROUTES,) if header.routes_width else ())
        + ((TEACHER,) if header.teacher_kl_weight else ())
    )


def _check_header(header: BatchHeader, num_frames: int) -> None:
    if not (0 <= header.rank < header.world_size == len(header.layout)):
        raise WireError(f"bad rank/world_size/layout: rank={header.rank} world_size={header.world_size}")
    if not (math.isfinite(header.temperature) and header.temperature > 0):
        raise WireError(f"temperature must be finite and > 0, got {header.temperature}")
    if header.num_loss_tokens < 0:
        raise WireError(f"num_loss_tokens must be >= 0, got {header.num_loss_tokens}")
    if header.routes_width < 0:
        raise WireError(f"routes_width must be >= 0, got {header.routes_width}")
    if not (math.isfinite(header.teacher_kl_weight) and header.teacher_kl_weight >= 0):
        raise WireError(f"teacher_kl_weight must be finite and >= 0, got {header.teacher_kl_weight}")
    expected = len(header.layout[header.rank]) * len(_frame_names(header))
    if len(header.arrays) != expected or num_frames != expected + len(header.images):
        raise WireError(
            f"step {header.step} rank {header.rank}: expected {expected} array frames, "
            f"header lists {len(header.arrays)}, got {num_frames}"
        )


def _decode_array(spec: ArraySpec, frame: bytes | memoryview, max_frame_bytes: int) -> np.ndarray:
    expected_dtype = {ROUTES: ROUTES_DTYPE, TEACHER: TEACHER_DTYPE}.get(spec.name) or ARRAY_DTYPES.get(
        spec.name
    )
    if expected_dtype is None:
        raise WireError(f"unknown array {spec.name!r}")
    if np.dtype(spec.dtype) != expected_dtype:
        raise WireError(f"array {spec.name} has dtype {spec.dtype}, expected {expected_dtype.str}")
    nbytes = len(frame) if isinstance(frame, bytes) else frame.nbytes
    if nbytes > max_frame_bytes:
        raise WireError(
            f"array {spec.name} frame of {nbytes} bytes exceeds max_frame_bytes={max_frame_bytes}"
        )
    if spec.length < 0 or nbytes != spec.length * expected_dtype.itemsize:
        raise WireError(f"array {spec.name}: {nbytes} bytes for {spec.length} x {expected_dtype.str}")
    return np.frombuffer(frame, dtype=expected_dtype)


def decode_rank_slice(
    frames: list[bytes | memoryview], *, max_frame_bytes: int
) -> tuple[BatchHeader, list[MicroBatch]]:
    """Decode a batch message into its header and this rank's micro-batches (arrays are read-only views)."""
    if not frames:
        raise WireError("empty message on the batch stream")
    msg = decode_message(frames[0])
    if not isinstance(msg, BatchHeader):
        raise WireError(f"expected a batch message, got {type(msg).__name__}: {msg}")
    _check_header(msg, len(frames) - 1)
    micro_batches: list[MicroBatch] = []
    names, width = _frame_names(msg), msg.routes_width
    n = len(names)
    for i, length in enumerate(msg.layout[msg.rank]):
        specs = msg.arrays[i * n : (i + 1) * n]
        if tuple(s.name for s in specs) != names:
            raise WireError(f"micro-batch {i}: arrays {[s.name for s in specs]} != {list(names)}")
        lengths = [s.length // width if s.name == ROUTES else s.length for s in specs]
        routes_ok = not width or specs[len(ARRAY_NAMES)].length == length * width
        if any(x != length for x in lengths) or not routes_ok:
            raise WireError(f"micro-batch {i}: array lengths {[s.length for s in specs]} != layout {length}")
        mb_frames = frames[1 + i * n : 1 + (i + 1) * n]
        arrays = {s.name: _decode_array(s, f, max_frame_bytes) for s, f in zip(specs, mb_frames, strict=True)}
        if width:
            arrays[ROUTES] = arrays[ROUTES].reshape(length, width)
        micro_batches.append(MicroBatch(**arrays))
    _attach_images(msg, micro_batches, frames[1 + len(msg.arrays) :], max_frame_bytes)
    local_loss_tokens = sum(mb.num_loss_tokens for mb in micro_batches)
    if local_loss_tokens > msg.num_loss_tokens:
        raise WireError(
            f"rank holds {local_loss_tokens} loss tokens > batch num_loss_tokens {msg.num_loss_tokens}"
        )
    return msg, micro_batches


def _attach_images(
    header: BatchHeader,
    micro_batches: list[MicroBatch],
    frames: list[bytes | memoryview],
    max_frame_bytes: int,
) -> None:
    """The image frames onto their micro-batches, each checked against its spec and its row."""
    ends = [0] * len(micro_batches)  # where the previous image of each row ended
    for spec, frame in zip(header.images, frames, strict=True):
        nbytes = len(frame) if isinstance(frame, bytes) else frame.nbytes
        if not 0 <= spec.micro_batch < len(micro_batches):
            raise WireError(f"image of micro-batch {spec.micro_batch}: this rank has {len(micro_batches)}")
        mb = micro_batches[spec.micro_batch]
        if (
            spec.offset < ends[spec.micro_batch]
            or spec.length < 1
            or spec.offset + spec.length > mb.num_tokens
        ):
            raise WireError(f"image at {spec.offset}+{spec.length} is out of order or outside its row")
        if nbytes != spec.nbytes or nbytes > max_frame_bytes:
            raise WireError(f"image frame of {nbytes} bytes (spec {spec.nbytes}, max {max_frame_bytes})")
        ends[spec.micro_batch] = spec.offset + spec.length
        mb.images.append(RowImage(spec.offset, spec.length, tuple(spec.grid_thw), bytes(frame)))

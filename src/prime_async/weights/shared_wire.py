"""What describes one weight version lent in shared memory (`weights.transport = "shared"`): msgspec
structs, never pickle. No torch here: the orchestrator only forwards these (control channel -> HTTP).

    SharedVersion(version, host, nbytes, tensors=[SharedTensor(name, dtype, shape, offset)], ...)
      CPU:  segment = path of a POSIX shared-memory file (/dev/shm/...) of `nbytes` bytes
      CUDA: cuda = CudaIpc(...): the parts of torch's CUDA IPC handle of one flat uint8 buffer
            (`torch.multiprocessing.reductions.reduce_tensor`), each field named and typed

Invariants: exactly one of `segment` / `cuda` is set; every tensor lies inside [0, nbytes) at an offset
that is a multiple of ALIGN (so a byte slice can be viewed as any dtype); `decode_share` checks both and
raises ValueError naming the problem, so an engine never maps memory from a malformed description.
On HTTP (the embedded engine's `/update_weights_from_tensor`, `load_format = SHARED_LOAD_FORMAT`) a
version travels as its JSON text (`encode_share`); bytes fields are base64 in JSON (msgspec's rule).
"""

from __future__ import annotations

import msgspec

ALIGN = 256  # bytes; offsets of tensors in the flat buffer (CUDA's allocation granularity for views)
SHARED_LOAD_FORMAT = "prime_async_shared"  # load_format of /update_weights_from_tensor with our JSON


class SharedTensor(msgspec.Struct, frozen=True):
    """One HF tensor inside the flat buffer: `nbytes(dtype, shape)` bytes from `offset`."""

    name: str
    dtype: str  # torch attribute name without "torch." ("float32", "bfloat16")
    shape: list[int]
    offset: int


class CudaIpc(msgspec.Struct, frozen=True):
    """The arguments of `torch.multiprocessing.reductions.rebuild_cuda_tensor` for a flat uint8 buffer,
    minus the classes (always UntypedStorage / torch.uint8) and with the device named by UUID: the
    engine may see the trainer's GPU under another index (its own CUDA_VISIBLE_DEVICES)."""

    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class SharedVersion(msgspec.Struct, frozen=True):
    """Weights `version` in one flat buffer of `nbytes` bytes on `host` (the trainer's hostname)."""

    version: int
    host: str
    nbytes: int
    tensors: list[SharedTensor]
    segment: str | None = None  # CPU: shared-memory file path
    cuda: CudaIpc | None = None  # CUDA: IPC handle of the buffer


_json_decoder = msgspec.json.Decoder(SharedVersion)


def encode_share(share: SharedVersion) -> str:
    """The JSON text of `share` (what `/update_weights_from_tensor` carries)."""
    return msgspec.json.encode(share).decode()


def decode_share(text: str | bytes) -> SharedVersion:
    """Parse and check a shared version; ValueError naming the first problem."""
    try:
        share = _json_decoder.decode(text)
    except msgspec.DecodeError as e:
        raise ValueError(f"shared weights: malformed description ({e})") from None
    check_share(share)
    return share


def check_share(share: SharedVersion) -> None:
    """The invariants of the module docstring; ValueError naming the tensor or field at fault."""
    if (share.segment is None) == (share.cuda is None):
        raise ValueError("shared weights: exactly one of `segment` (CPU) and `cuda` (CUDA IPC) must be set")
    if share.nbytes < 0:
        raise ValueError(f"shared weights: nbytes {share.nbytes} < 0")
    for t in share.tensors:
        if t.offset < 0 or t.offset % ALIGN:
            raise ValueError(f"shared weights: {t.name} at offset {t.offset}, not a multiple of {ALIGN}")
        if any(dim < 0 for dim in t.shape):
            raise ValueError(f"shared weights: {t.name} has a negative dimension in {t.shape}")
        end = t.offset + tensor_nbytes(t.dtype, t.shape)
        if end > share.nbytes:
            raise ValueError(f"shared weights: {t.name} ends at byte {end}, past the buffer ({share.nbytes})")


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int8": 1,
            "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}  # fmt: skip


def tensor_nbytes(dtype: str, shape: list[int]) -> int:
    """Bytes of a contiguous tensor; ValueError for a dtype not in ITEMSIZE."""
    if dtype not in ITEMSIZE:
        raise ValueError(f"shared weights: dtype {dtype!r} is not one of {sorted(ITEMSIZE)}")
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * ITEMSIZE[dtype]


def layout(metas: list[tuple[str, str, list[int]]]) -> tuple[list[SharedTensor], int]:
    """Offsets of (name, dtype, shape) in one flat buffer, each aligned to ALIGN; -> (tensors, nbytes)."""
    tensors, offset = [], 0
    for name, dtype, shape in metas:
        tensors.append(SharedTensor(name, dtype, list(shape), offset))
        offset += -(-tensor_nbytes(dtype, shape) // ALIGN) * ALIGN
    return tensors, offset

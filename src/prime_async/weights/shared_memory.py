"""Weights in shared memory (`weights.transport = "shared"`): trainer rank 0 and the engines on one host,
or one GPU, with no process group between them (NCCL refuses two ranks on one GPU).

    trainer rank 0 (SharedStore)                             engine (open_share)
      put(state, v): copy into ONE flat uint8 buffer           /update_weights_from_tensor(SharedVersion)
        CPU:  a POSIX shared-memory file /dev/shm/prime-async-<pid>-<id>-v<v> (MAP_SHARED)
        CUDA: torch.empty on the trainer's GPU
      lend(v, copies) -> SharedVersion per engine ───────────►  map the buffer (CPU: the file, read-only
        (CUDA: one torch IPC handle per engine: each engine      copy-on-write; CUDA: rebuild_cuda_tensor
         releases its own reference count)                       on the GPU found by UUID), view each
      give_back(v)                                               tensor, copy into the model, synchronize

Invariants: a version is lent from a copy made at `put` (never a view of parameters the optimizer
changes); the store holds the newest `keep` versions plus the one lent last (a lent version is never
freed, unlinked or reused before `give_back(v)` or the next `lend`), so an engine's copy never reads
freed memory; a dropped CPU segment is renamed at once and reused by the next put (no description of
the dropped version finds it); an engine has finished copying (CUDA: synchronized) before its HTTP
answer, i.e. before the orchestrator gives the version back; nothing is pickled: the descriptions are
`shared_wire` structs.
CUDA IPC handles are valid on the same machine only; the engine must see the trainer's GPU (found by
UUID, whatever its local index). A crashed trainer's files are removed by the next trainer on the host
(`sweep_stale`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from prime_async.weights.control import VERSION_GONE
from prime_async.weights.shared_wire import CudaIpc, SharedTensor, SharedVersion, layout, tensor_nbytes
from prime_async.weights.tensor_meta import dtype_name, dtype_of

logger = logging.getLogger(__name__)

_STALE = re.compile(r"^prime-async-(\d+)-[0-9a-f]+-(v\d+|spare)$")


def shm_dir() -> Path:
    """Where CPU segments live: /dev/shm (POSIX shared memory on Linux), else the temp directory."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def view(buffer: torch.Tensor, t: SharedTensor) -> torch.Tensor:
    """Tensor `t` as a view of the flat uint8 `buffer` (no copy)."""
    n = tensor_nbytes(t.dtype, t.shape)
    return buffer[t.offset : t.offset + n].view(dtype_of(t.dtype)).view(t.shape)


class _Held:
    def __init__(self, buffer: torch.Tensor, tensors: list[SharedTensor], nbytes: int, path: Path | None):
        self.buffer, self.tensors, self.nbytes, self.path = buffer, tensors, nbytes, path

    def free(self) -> None:
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.buffer = torch.empty(0, dtype=torch.uint8)


class SharedStore:
    """Trainer rank 0's versions in shared memory (module docstring); thread-safe (training thread puts,
    the control thread lends and gives back)."""

    def __init__(self, device: torch.device, keep: int):
        if keep < 1:
            raise ValueError(f"shared weights: keep {keep} < 1")
        self.device, self.keep = torch.device(device), keep
        self.prefix = f"prime-async-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.host = socket.gethostname()
        self._held: OrderedDict[int, _Held] = OrderedDict()
        self._spare: _Held | None = None  # CPU: the segment of a dropped version, reused by the next put
        self._lent: int | None = None
        self._lock = threading.Lock()
        if self.device.type != "cuda":
            sweep_stale(shm_dir())

    def put(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `state` into a flat buffer for `version` (CPU: the spare segment when it has the size,
        else a new one), then drop the oldest versions beyond `keep` (never the lent one)."""
        metas = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in state.items()]
        tensors, nbytes = layout(metas)
        with self._lock:
            old = self._held.pop(version, None)
            if old is not None:
                self._retire(old)
            buffer, path = self._buffer(nbytes, version)
        for t in tensors:
            view(buffer, t).copy_(state[t.name].detach())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with self._lock:
            self._held[version] = _Held(buffer, tensors, nbytes, path)
            self._evict()

    def _buffer(self, nbytes: int, version: int) -> tuple[torch.Tensor, Path | None]:
        """A buffer of `nbytes` for `version`. CPU: the spare segment renamed to the version's name when
        its size fits (its pages are already mapped: ~5x faster than faulting in a new tmpfs file)."""
        if self.device.type == "cuda":
            return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device), None
        path = shm_dir() / f"{self.prefix}-v{version}"
        spare, self._spare = self._spare, None
        if spare is not None and spare.nbytes == nbytes and spare.path is not None:
            os.rename(spare.path, path)
            return spare.buffer, path
        if spare is not None:
            spare.free()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        return torch.from_file(str(path), shared=True, size=max(nbytes, 1), dtype=torch.uint8), path

    def _retire(self, held: _Held) -> None:
        """A version no longer held. CPU: its segment becomes the spare, renamed at once, so a description
        of that version no longer finds it (an engine is refused, never handed other weights)."""
        if held.path is None or self._spare is not None:
            held.free()
            return
        spare_path = shm_dir() / f"{self.prefix}-spare"
        os.rename(held.path, spare_path)
        held.path = spare_path
        self._spare = held

    def _evict(self) -> None:
        newest = list(self._held)[-self.keep :]
        for version in [v for v in self._held if v not in newest and v != self._lent]:
            self._retire(self._held.pop(version))

    def versions(self) -> list[int]:
        with self._lock:
            return list(self._held)

    def lend(self, version: int, copies: int) -> list[SharedVersion]:
        """Descriptions of `version` for `copies` engines; it stays held until `give_back(version)` or
        the next `lend`. ValueError (containing VERSION_GONE) when it is no longer held."""
        if copies < 1:
            raise ValueError(f"shared weights: {copies} engines to lend to")
        with self._lock:
            held = self._held.get(version)
            if held is None:
                raise ValueError(f"cannot lend version {version}: {VERSION_GONE}: {list(self._held)}")
            self._lent = version
            self._evict()
            if held.path is not None:
                share = SharedVersion(version, self.host, held.nbytes, held.tensors, segment=str(held.path))
                return [share] * copies
            return [
                SharedVersion(version, self.host, held.nbytes, held.tensors, cuda=cuda_ipc(held.buffer))
                for _ in range(copies)
            ]

    def give_back(self, version: int) -> None:
        """The engines finished copying `version`: it may be dropped like any other."""
        with self._lock:
            if self._lent == version:
                self._lent = None
                self._evict()

    def close(self) -> None:
        """Free every version (CPU: unlink every segment)."""
        with self._lock:
            for held in [*self._held.values(), *([self._spare] if self._spare else [])]:
                held.free()
            self._held.clear()
            self._spare, self._lent = None, None


def sweep_stale(directory: Path) -> int:
    """Remove segments of trainers that are no longer running (pid in the name); returns how many."""
    removed = 0
    for path in directory.glob("prime-async-*"):
        match = _STALE.match(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
    if removed:
        logger.info("removed %d shared-memory weight segment(s) of trainers no longer running", removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


# ---- CUDA IPC handles, field by field ------------------------------------------------------------------


def cuda_ipc(buffer: torch.Tensor) -> CudaIpc:
    """torch's IPC handle of `buffer` (one new reference count: the engine that opens it releases it)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    return ipc_from_args(args)


def ipc_from_args(args: tuple) -> CudaIpc:
    """The explicit fields of `rebuild_cuda_tensor`'s arguments (reduce_tensor's order, torch 2.x)."""
    (_, size, _, tensor_offset, _, dtype, device, handle, storage_size, storage_offset, _, ref_handle,
     ref_offset, event_handle, event_sync) = args  # fmt: skip
    if dtype != torch.uint8 or tensor_offset != 0 or len(size) != 1:
        raise ValueError(f"shared weights: a flat uint8 buffer is lent, not {dtype} {tuple(size)}")
    return CudaIpc(
        device_uuid=device_uuid(device),
        handle=bytes(handle),
        storage_size_bytes=int(storage_size),
        storage_offset_bytes=int(storage_offset),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync),
    )


def args_from_ipc(ipc: CudaIpc, nbytes: int, device_index: int) -> tuple:
    """`rebuild_cuda_tensor`'s arguments for the flat buffer described by `ipc` on local `device_index`."""
    size = max(nbytes, 1)
    return (torch.Tensor, torch.Size([size]), (1,), 0, torch.storage.TypedStorage, torch.uint8, device_index,
            ipc.handle, ipc.storage_size_bytes, ipc.storage_offset_bytes, False, ipc.ref_counter_handle,
            ipc.ref_counter_offset, ipc.event_handle, ipc.event_sync_required)  # fmt: skip


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid_: str) -> int:
    """This process's index of the GPU `uuid_`; ValueError when it is not visible here."""
    seen = [device_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid_ not in seen:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise ValueError(
            f"shared weights: the trainer's GPU {uuid_} is not visible to this engine "
            f"(CUDA_VISIBLE_DEVICES={visible}, {len(seen)} GPU(s)): weights.transport = 'shared' needs "
            "trainer rank 0 and the engine on one machine, the trainer's GPU visible to the engine"
        )
    return seen.index(uuid_)


# ---- engine side -------------------------------------------------------------------------------------


@contextlib.contextmanager
def open_share(share: SharedVersion) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of `share`, as views of the mapped buffer, for the duration of the block (the caller
    copies them; CUDA: synchronized on exit, before the mapping is dropped). ValueError naming the
    problem when the buffer cannot be mapped here."""
    here = socket.gethostname()
    if share.host != here:
        raise ValueError(
            f"shared weights: version {share.version} lives on host {share.host!r}, this engine runs on "
            f"{here!r}: weights.transport = 'shared' needs trainer rank 0 and the engines on one host"
        )
    buffer = _map_cpu(share) if share.segment is not None else _map_cuda(share)
    try:
        yield {t.name: view(buffer, t) for t in share.tensors}
    finally:
        if buffer.is_cuda:  # the copy may run on another GPU than the buffer's: wait for every one
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)
        del buffer


def _map_cpu(share: SharedVersion) -> torch.Tensor:
    assert share.segment is not None
    path = Path(share.segment)
    if path.parent != shm_dir() or not path.name.startswith("prime-async-"):
        raise ValueError(f"shared weights: {share.segment!r} is not a prime-async segment in {shm_dir()}")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ValueError(
            f"shared weights: segment {share.segment} of version {share.version} does not exist (the trainer "
            "dropped it, or runs on another host)"
        ) from None
    if size < max(share.nbytes, 1):
        raise ValueError(f"shared weights: segment {share.segment} has {size} bytes, expected {share.nbytes}")
    return torch.from_file(str(path), shared=False, size=max(share.nbytes, 1), dtype=torch.uint8)


def _map_cuda(share: SharedVersion) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    assert share.cuda is not None
    if not torch.cuda.is_available():
        raise ValueError("shared weights: the trainer lent a CUDA buffer but this engine has no CUDA")
    index = local_index(share.cuda.device_uuid)
    return rebuild_cuda_tensor(*args_from_ipc(share.cuda, share.nbytes, index))

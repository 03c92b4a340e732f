"""Pure helpers the process backend's controller and workers share: who holds what, who talks to whom.

A mesh's device id is the worker's rank. Everything here is a function of specs (and a rank), so
the controller and every worker compute the same answer without asking each other.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..placement import Replicate
from ..spec import DTensorSpec, move_transfers  # noqa: F401  (moves between meshes: pure spec arithmetic)
from .blocks import cut_shape, nbytes  # noqa: F401  (the workers' and the controller's byte arithmetic)

CHUNK = 4 << 20  # bytes per TCPStore value: the libuv store refuses payloads over 8 MiB


# -- meshes ----------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def rank_coords(mesh) -> dict:
    """rank -> its coordinate in ``mesh``."""
    return dict(zip(mesh.device_ids, mesh.coordinates()))


def members(mesh, coord, dim: int) -> tuple:
    """Ranks along mesh dim ``dim`` through ``coord``, in mesh order."""
    idx = list(coord)
    out = []
    for j in range(mesh.shape[dim]):
        idx[dim] = j
        out.append(mesh.device_id(idx))
    return tuple(out)


@lru_cache(maxsize=4096)
def dim_groups(mesh, dim: int) -> tuple:
    """Every group of ranks along mesh dim ``dim`` (each in mesh order)."""
    seen = {}
    for coord in mesh.coordinates():
        g = members(mesh, coord, dim)
        seen.setdefault(g, None)
    return tuple(seen)


@lru_cache(maxsize=4096)
def same_rank_order(mesh, dim: int) -> bool:
    """Do all groups along mesh dim ``dim`` order their members alike (mesh position -> group rank)?

    torch.distributed ranks a group's members by global rank, and a native all_reduce / reduce_scatter
    adds the terms in an order set by those group ranks. When every group has the same mapping, replicas
    along the other mesh dims add their (equal) terms in the same order and stay bit-identical.
    """
    orders = {tuple(sorted(range(len(g)), key=g.__getitem__)) for g in dim_groups(mesh, dim)}
    return len(orders) <= 1


@lru_cache(maxsize=4096)
def grid_coords(spec: DTensorSpec) -> tuple:
    """The coordinates whose blocks determine the global value: index 0 on Replicate mesh dims."""
    return tuple(c for c in spec.mesh.coordinates()
                 if all(c[i] == 0 for i, p in enumerate(spec.placements) if isinstance(p, Replicate)))


# -- tensors <-> bytes -----------------------------------------------------------------------------

INLINE_BYTES = 256 << 10  # blocks up to this size travel inside an op record (or a fetch's answer)



def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s values (collectives and the store move bytes of any dtype)."""
    flat = t.reshape(-1)
    if not flat.numel():  # an empty block may keep its view's stride, which .view(uint8) refuses
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if flat.stride(0) != 1:  # e.g. one element of a strided view: "contiguous", stride 4
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    if b.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=b.device)
    return b.view(dtype).reshape(shape)


HUGE_PAGE_BYTES = 32 << 20  # fetched values from this size on go in transparent huge pages


def empty_result(shape, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor to assemble a fetched global value in. A large one is an anonymous mapping the
    kernel may back with 2 MiB pages: touching hundreds of MB of fresh 4 KiB pages for the first time
    costs more than copying into them (measured: 256 MB in 60 ms instead of 135 ms)."""
    import mmap

    size = nbytes(shape, dtype)
    if size < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(area, dtype=torch.uint8).view(dtype).reshape(shape)  # the tensor keeps ``area``


# dtypes numpy holds: their blocks' bytes come from one numpy call (a replayed step places its host data each time)
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.complex128, torch.complex64, torch.int64,
                           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})


def to_blob(t: torch.Tensor) -> bytes:
    """``t``'s values as bytes, in row-major order (``from_blob`` reads them back)."""
    t = t.detach()
    if t.dtype in _NUMPY_DTYPES and t.device.type == "cpu" and not t.is_conj() and not t.is_neg():
        return t.numpy().tobytes()  # (numpy writes any strides row-major too: as_bytes's order)
    return as_bytes(t.cpu()).numpy().tobytes()


def from_blob(data, dtype: torch.dtype, shape) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return from_bytes(torch.frombuffer(bytearray(data), dtype=torch.uint8), dtype, shape)


def store_put(store, key: str, data: bytes) -> None:
    """Write ``data`` under ``key`` in chunks the store accepts (the reader knows the size)."""
    if not data:
        return
    for n, off in enumerate(range(0, len(data), CHUNK)):
        store.set(f"{key}/{n}", data[off:off + CHUNK])


def store_take(store, key: str, size: int, delete: bool = True) -> bytes:
    if size == 0:
        return b""
    parts = store.multi_get([f"{key}/{n}" for n in range(-(-size // CHUNK))])
    if delete:
        store_drop(store, key, size)
    return b"".join(parts)


def store_drop(store, key: str, size: int) -> None:
    for n in range(-(-size // CHUNK)):
        store.delete_key(f"{key}/{n}")


# -- same-host data plane: blocks in shared memory files ------------------------------------------
# The controller owns one directory in /dev/shm per pool (``shm_dir``); a block travels as a file in it,
# the record carrying only its name and size. The reader maps the file privately (copy-on-write, no
# copy) and unlinks it; the directory goes when the pool stops, faults included, so nothing is left.
# A controller killed outright cannot remove it: its workers' watchdogs do (``worker._orphaned``), and
# where none could (the ray backend's actors are killed with the driver; everything killed at once),
# the next ``shm_dir`` on the host does: the owner holds a lock on the directory's ``lock`` file for
# as long as it lives, and a lock nobody holds marks an orphan (pids would not: other containers).

SHM_ROOT = "/dev/shm"
_SHM_LOCKS: dict = {}  # directory -> the open file holding its lock, while this process owns it


def shm_dir() -> tuple | None:
    """(directory, token) for this pool's files, or None where there is no /dev/shm."""
    import fcntl
    import os
    import secrets

    if not os.path.isdir(SHM_ROOT) or not os.access(SHM_ROOT, os.W_OK):
        return None
    shm_sweep()
    token = secrets.token_hex(8)
    path = os.path.join(SHM_ROOT, f"dtorch-{os.getpid()}-{token}")
    making = os.path.join(SHM_ROOT, f".making-dtorch-{token}")  # named as a pool's once locked (a sweep skips it)
    os.mkdir(making, 0o700)
    fd = os.open(os.path.join(making, "lock"), os.O_RDWR | os.O_CREAT, 0o600)  # (not inherited by workers)
    fcntl.flock(fd, fcntl.LOCK_EX)
    with open(os.path.join(making, "token"), "w") as f:
        f.write(token)
    os.rename(making, path)
    _SHM_LOCKS[path] = fd
    return path, token


def shm_drop(where) -> None:
    """Remove a pool's directory (``shm_dir``) with what is left in it, and let go of its lock."""
    import os
    import shutil

    if where:
        shutil.rmtree(where[0], ignore_errors=True)
        fd = _SHM_LOCKS.pop(where[0], None)
        if fd is not None:
            os.close(fd)


def shm_sweep() -> list[str]:
    """Remove the pool directories whose owner died without removing them; the ones removed."""
    import fcntl
    import os
    import shutil

    gone = []
    for name in os.listdir(SHM_ROOT):
        path = os.path.join(SHM_ROOT, name)
        if not name.startswith("dtorch-") or path in _SHM_LOCKS:
            continue
        try:
            fd = os.open(os.path.join(path, "lock"), os.O_RDWR)
        except OSError:
            continue  # no lock file (made by an older dtorch) or just removed: not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives
        finally:
            os.close(fd)  # (a lock taken above goes with it; the directory goes next)
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


def shm_reachable(where) -> str | None:
    """The directory, if this process sees the controller's (same host), else None (use the store)."""
    import os

    if not where:
        return None
    path, token = where
    try:
        with open(os.path.join(path, "token")) as f:
            return path if f.read() == token else None
    except OSError:
        return None


def free_bytes(path: str) -> int:
    """Bytes an unprivileged process may still write to the file system holding ``path``."""
    import os

    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def shm_write(path: str, t: torch.Tensor) -> int:
    """Write ``t``'s bytes to a new file ``path``; returns their count."""
    b = as_bytes(t.detach().cpu())
    with open(path, "wb") as f:
        if b.numel():
            f.write(memoryview(b.numpy()))
    return b.numel()


def shm_write_at(path: str, offset: int, t: torch.Tensor) -> None:
    """Write ``t``'s bytes into the existing file ``path`` at byte ``offset``."""
    import os

    fd = os.open(path, os.O_WRONLY)
    try:
        write_at(fd, offset, t)
    finally:
        os.close(fd)


def write_at(fd: int, offset: int, t: torch.Tensor) -> None:
    """Write ``t``'s bytes into the open file ``fd`` at byte ``offset``."""
    import os

    view = memoryview(as_bytes(t.detach().cpu()).numpy())
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def contiguous_offset(spec: DTensorSpec, coord) -> int | None:
    """The byte offset of ``coord``'s block in the global value when the block is one contiguous run
    of it (it splits at most the first dim it does not span fully, and only one-long dims before), else None."""
    box = spec.local_box(coord)  # (start, length) per dim
    if any(length == 0 for _, length in box):
        return 0  # an empty block: nothing to write
    offset, stride, split = 0, nbytes((), spec.dtype), False
    for (start, length), n in reversed(list(zip(box, spec.shape))):
        if split and length != 1:
            return None
        offset += start * stride
        if length != n:
            split = True
        stride *= n
    return offset


def shm_take(path: str, size: int, dtype: torch.dtype, shape, unlink: bool = True) -> torch.Tensor:
    """The block in file ``path``, mapped privately: writes stay in this process, and the pages outlive
    the unlink (they go with the tensor)."""
    import os

    if size == 0:
        out = torch.empty(shape, dtype=dtype)
    else:
        out = from_bytes(torch.from_file(path, shared=False, size=size, dtype=torch.uint8), dtype, shape)
    if unlink:
        os.unlink(path)
    return out


# -- collectives on one mesh dim ---------------------------------------------------------------------


def member_shapes(spec: DTensorSpec, coord, dim: int) -> tuple:
    """Block shapes of the devices along mesh dim ``dim`` through ``coord``, in mesh order."""
    c = list(coord)
    out = []
    for j in range(spec.mesh.shape[dim]):
        c[dim] = j
        out.append(spec.local_shape(tuple(c)))
    return tuple(out)


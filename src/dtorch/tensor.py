"""dtorch.Tensor: a global-view tensor whose blocks live on the devices of a mesh.

The front object holds only a spec (mesh, placements, global shape, dtype), the runtime's storage
handle and its Graph. The operator methods (``x.sum()``, ``x + y``, ``x.view(...)``, ``x.T``) are not
written here: they come from the op table (``dtorch.ops.table.TABLE``, one entry per op, with the
Tensor attributes that lead to it), bound by ``Tensor._install_ops`` below, which ``dtorch/__init__``
calls once after importing ``dtorch.ops``. ``dir(dtorch.Tensor)`` or ``TABLE`` lists them.
"""
from __future__ import annotations

import numbers

import numpy as np
import torch

from .errors import MeshError, PlacementError
from .graph import Graph, register_tensor_type, resolve_graph
from .mesh import DeviceMesh
from .placement import Placement, Replicate, Shard, fmt_placements, normalize_placements
from .spec import DTensorSpec

_REPLICATE = Replicate()
_new_object = object.__new__


class Tensor:
    # _writes: in-place writes so far (unset until the first; read through ``_version``). The views of this
    # tensor (ops/views.py) compare it with the count their value was computed at
    # _ag: autograd metadata (dtorch.autograd.node.AutogradMeta), None when the tensor has no history and
    # requires no grad (the one slot every op reads to decide whether to record)
    # _quiet: the writes among ``_writes`` made through ``.data`` (torch does not count them in ``_version``); set
    # whenever _writes is
    __slots__ = ("_spec", "_h", "_graph", "_writes", "_ag", "_quiet", "__weakref__")

    def __init__(self, *args, device_mesh: DeviceMesh | None = None, placements=None, dtype: torch.dtype | None = None,
                 graph: Graph | None = None):
        """``Tensor(data)`` (a torch or dtorch tensor, a number, a nested list, a numpy array) or, as
        ``torch.Tensor``, a new tensor of a size: ``Tensor()`` (empty, [0]), ``Tensor(2, 3)``,
        ``Tensor(torch.Size([2, 3]))`` (values unspecified: zeros, like ``dtorch.empty``). ``graph``: the
        Graph it lives in (default: this thread's default Graph)."""
        given = None if graph is None else resolve_graph(graph)
        graph = given or Graph.default_graph()
        data = _constructor_data(args, dtype, graph)
        if isinstance(data, Tensor) and given is not None and data._graph is not given:
            # another Graph's blocks (a process Graph's live in its workers): the value is copied over, laid
            # out as the source unless told otherwise
            device_mesh = data.device_mesh if device_mesh is None else device_mesh
            if placements is None and device_mesh == data.device_mesh:
                placements = data.placements
            data = data.to_torch()
        if isinstance(data, Tensor):
            src = data.to(dtype) if dtype is not None else data
            mesh = device_mesh or src.device_mesh
            out = src.redistribute(mesh, placements if placements is not None else (src.placements if mesh == src.device_mesh else None))
            # a handle of its own (writes to either tensor copy first: neither sees the other's)
            handle = out._graph.runtime.alias(out._h, out._spec) if out._h is data._h else out._h
            self._init(out._spec, handle, out._graph)
            return
        full = as_torch(data, dtype or None, graph)
        mesh = graph.default_device_mesh if device_mesh is None else device_mesh
        if not isinstance(mesh, DeviceMesh):
            raise MeshError(f"device_mesh must be a DeviceMesh, got {type(mesh).__name__}")
        spec = DTensorSpec(mesh, normalize_placements(placements, mesh.ndim, full.ndim, mesh.shape), tuple(full.shape),
                           full.dtype)
        self._init(spec, graph.runtime.from_global(full, spec), graph)

    # -- construction without data copies -------------------------------------------------------
    def _init(self, spec: DTensorSpec, handle, graph: Graph) -> None:
        self._spec = spec
        self._h = handle
        self._graph = graph
        self._ag = None
        if graph.tracks_memory:  # memory accounting: the Graph counts the handle until it dies
            graph._on_handle(handle, spec)

    @classmethod
    def _make(cls, spec: DTensorSpec, handle, graph: Graph) -> "Tensor":
        t = _new_object(cls)  # (every op's output comes through here: no attribute lookup for object.__new__)
        t._spec = spec
        t._h = handle
        t._graph = graph
        t._ag = None
        if graph.tracks_memory:
            graph._on_handle(handle, spec)
        return t

    def _written(self, handle) -> None:
        """An in-place op wrote this tensor: ``handle`` holds its value now (its own handle, or the
        runtime's copy-on-write copy)."""
        if handle is not self._h:
            self._graph._rehandle(self, handle)  # self._h = handle; the memory accounting keeps its kind
        try:
            self._writes = _get_writes(self) + 1
        except AttributeError:  # the first write
            self._writes, self._quiet = 1, 0

    @property
    def _version(self) -> int:
        """How many in-place writes this tensor has had (torch's ``Tensor._version``; writes through ``.data``
        do not count, as in torch): a cache of its value (a copy on another mesh) is stale when this moved."""
        try:
            return _get_writes(self) - self._quiet
        except AttributeError:  # never written
            return 0

    @classmethod
    def from_blocks(cls, blocks, *, device_mesh: DeviceMesh, placements, shape) -> "Tensor":
        """A tensor from each device's block, in mesh order (``device_mesh.coordinates()``).

        Every block must have the shape its device holds under ``placements`` for the global
        ``shape`` (torch.chunk sizes); devices that differ only on Replicate mesh dims must hold equal
        blocks; Partial mesh dims take arbitrary terms (the value is their reduction).
        """
        blocks = list(blocks)
        if not blocks or not all(isinstance(b, torch.Tensor) for b in blocks):
            raise TypeError("from_blocks needs one torch.Tensor per device")
        if len(blocks) != device_mesh.size():
            raise PlacementError(f"from_blocks got {len(blocks)} blocks for the {device_mesh.size()} devices of {device_mesh}")
        shape = tuple(int(s) for s in shape)
        spec = DTensorSpec(device_mesh, normalize_placements(placements, device_mesh.ndim, len(shape), device_mesh.shape), shape,
                           blocks[0].dtype)
        for n, (b, coord) in enumerate(zip(blocks, device_mesh.coordinates())):
            want = spec.local_shape(coord)
            if tuple(b.shape) != want or b.dtype != spec.dtype:
                raise PlacementError(
                    f"from_blocks: block {n} (device {device_mesh.device_ids[n]}, coordinate {coord}) has shape "
                    f"{list(b.shape)} {b.dtype}, but {spec} puts a {list(want)} {spec.dtype} block there")
        graph = Graph.default_graph()
        return cls._make(spec, graph.runtime.from_blocks(blocks, spec), graph)

    # -- metadata ---------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._spec.shape)

    def size(self, dim: int | None = None):
        if dim is None:
            return torch.Size(self._spec.shape)
        return self._spec.shape[dim]

    def dim(self) -> int:
        return len(self._spec.shape)

    ndimension = dim
    is_meta = False  # (torch code such as nn.init skips meta tensors) a dtorch tensor always holds values

    @property
    def ndim(self) -> int:
        return len(self._spec.shape)

    def numel(self) -> int:
        n = 1
        for s in self._spec.shape:
            n *= s
        return n

    def __len__(self):
        if not self._spec.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._spec.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._spec.dtype

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> list[Placement]:
        return list(self._spec.placements)

    @property
    def spec(self) -> DTensorSpec:
        return self._spec

    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def is_floating_point_type(self) -> bool:
        return self._spec.dtype.is_floating_point

    def is_floating_point(self) -> bool:
        return self._spec.dtype.is_floating_point

    def element_size(self) -> int:
        return self._spec.dtype.itemsize

    @property
    def device(self) -> torch.device:
        devs = self._graph.runtime.devices(self._spec.mesh) if hasattr(self._graph.runtime, "devices") else None
        return devs[0] if devs else torch.device(self._spec.mesh.device_type)

    # -- values ---------------------------------------------------------------------------------
    def to_torch(self) -> torch.Tensor:
        """The whole global tensor as a new torch tensor (blocks gathered, partial terms reduced)."""
        return self._graph.runtime.to_global(self._h, self._spec)  # a fresh tensor (the runtime's contract)

    full_tensor = to_torch

    def to_torch_async(self):
        return self._graph.runtime.to_global_async(self._h, self._spec)

    def local_blocks(self) -> list[torch.Tensor]:
        """Every device's block, in mesh order (read-only views; for debugging and tests)."""
        return list(self._graph.runtime.local_blocks(self._h, self._spec))

    def item(self):
        if self.numel() != 1:
            raise ValueError(f"item() needs a tensor with one element, got shape {list(self.shape)}")
        return self.to_torch().item()

    def tolist(self):
        return self.to_torch().tolist()

    def numpy(self):
        return self.to_torch().numpy()

    def __bool__(self):
        return bool(self.item())

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        if self._spec.dtype.is_floating_point:
            raise TypeError("only integer tensors can be used as an index")
        return int(self.item())

    def __array__(self, dtype=None, copy=None):
        a = self.to_torch().numpy()
        return a.astype(dtype) if dtype is not None else a

    def __repr__(self):
        body = repr(self.to_torch()).replace("tensor(", "dtorch.Tensor(", 1)
        mesh = self._spec.mesh
        names = f", mesh_dim_names={mesh.dim_names}" if mesh.dim_names else ""
        return (f"{body[:-1]},\n       device_mesh=DeviceMesh({mesh.device_type!r}, {mesh.mesh.tolist()}{names}), "
                f"placements={fmt_placements(self._spec.placements)})")

    # -- redistribution -------------------------------------------------------------------------
    # redistribute(device_mesh, placements): dtorch.autograd.redistribute (differentiable; installed by
    # dtorch/__init__ with the other autograd methods, as autograd sits above this module)

    def redistribute_by_dict(self, device_mesh: DeviceMesh | None = None, placements_dict=None,
                             default_placement_mode: str = "keep") -> "Tensor":
        mesh = device_mesh or self._spec.mesh
        placements_dict = dict(placements_dict or {})
        modes = ("keep", "replicate", "raise_error")
        if default_placement_mode not in modes:
            raise ValueError(f"default_placement_mode must be one of {modes}, got {default_placement_mode!r}")
        names = mesh.dim_names or []
        by_index = {}
        for name, p in placements_dict.items():
            idx = mesh.dim_name_index(name) if isinstance(name, str) else name
            if idx is not None:
                by_index[idx] = p
        placements, missing = [], []
        for i in range(mesh.ndim):
            if i in by_index:
                placements.append(by_index[i])
            elif default_placement_mode == "replicate":
                placements.append(_REPLICATE)
            elif default_placement_mode == "raise_error":
                missing.append(names[i] if i < len(names) else i)
            else:
                placements.append(self._keep_placement(mesh, i))
        if missing:
            # an unnamed mesh cannot be addressed by name at all: say how to fix that first
            hint = ("this mesh has no dim names, so placements_dict can only use mesh dim indices; build the mesh "
                    "with mesh_dim_names=[...] or " if not names else "")
            raise PlacementError(
                f"redistribute_by_dict(default_placement_mode='raise_error'): no placement given for mesh dims "
                f"{missing} of {mesh}; {hint}add them to placements_dict or use default_placement_mode='keep' or "
                "'replicate'"
            )
        return self.redistribute(mesh, placements)

    def _keep_placement(self, mesh: DeviceMesh, i: int) -> Placement:
        """The current placement of the mesh dim that corresponds to ``mesh`` dim ``i`` (by name, else index)."""
        src = self._spec.mesh
        if mesh == src:
            return self._spec.placements[i]
        name = mesh.dim_names[i] if mesh.dim_names else None
        j = src.dim_name_index(name) if name is not None else (i if not src.dim_names and i < src.ndim else None)
        return self._spec.placements[j] if j is not None else _REPLICATE

    def redistribute_like(self, other: "Tensor") -> "Tensor":
        return self.redistribute(other.device_mesh, other.placements)

    def check_placement(self, mesh_dim: int | str, placement: Placement) -> bool:
        i = self._spec.mesh.resolve_dim(mesh_dim)
        p = placement
        if isinstance(p, Shard) and p.dim < 0:
            p = Shard(p.dim % max(self.ndim, 1))
        return self._spec.placements[i] == p

    def to(self, *args, **kwargs) -> "Tensor":
        """``.to(device_mesh)``, ``.to(dtype)``, ``.to(device)``, ``.to(other)``; like torch, returns self when
        nothing changes.

        A device of the mesh's own type changes nothing (the tensor already lives on such devices); a
        device of another type moves the tensor to the same-shaped mesh of that type.
        """
        dtype = kwargs.pop("dtype", None)
        target_mesh = kwargs.pop("device_mesh", None)
        device = kwargs.pop("device", None)
        for ignored in ("non_blocking", "copy", "memory_format"):  # no effect on immutable global tensors
            kwargs.pop(ignored, None)
        if kwargs:
            raise TypeError(f"Tensor.to got unexpected arguments {sorted(kwargs)}")
        for a in args:
            if isinstance(a, DeviceMesh):
                target_mesh = a
            elif isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, (str, torch.device)):
                device = a
            elif isinstance(a, Tensor):
                dtype, target_mesh = a.dtype, a.device_mesh
            elif isinstance(a, torch.Tensor):
                dtype, device = a.dtype, a.device
            elif not isinstance(a, bool):  # torch's positional non_blocking / copy flags
                raise TypeError(f"Tensor.to expects a DeviceMesh, a torch.dtype, a device or a tensor, got {a!r}")
        if device is not None and target_mesh is None:
            kind = torch.device(device).type
            mesh = self._spec.mesh
            if kind != mesh.device_type:
                target_mesh = DeviceMesh(kind, mesh.mesh, mesh_dim_names=mesh.dim_names)
        out = self
        if dtype is not None and dtype != self.dtype:
            out = self._cast(out, dtype)
        if target_mesh is not None and target_mesh != out.device_mesh:
            if target_mesh.ndim == out.device_mesh.ndim:
                out = out.redistribute(target_mesh, out.placements)
            else:
                out = out.redistribute(target_mesh, [_REPLICATE] * target_mesh.ndim)
        return out

    # clone, requires_grad, grad, backward: dtorch.autograd.tensor_methods (installed by dtorch/__init__); detach:
    # ops/views.py

    def __hash__(self):
        return id(self)

    # x[index] = value: Tensor.__setitem__ is bound from the op table (ops/index.py)

    def contiguous(self, memory_format=None) -> "Tensor":
        return self  # blocks have no strides to fix: a tensor that is no view is "contiguous" (views: ops/views.py)

    def is_contiguous(self, memory_format=None) -> bool:
        return True

    # torch functions (``torch.matmul(x, w)``, ``F.silu(x)``) route to dtorch's ops
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return cls._torch_function(func, args, kwargs or {})

    # -- operators: bound from the op table -------------------------------------------------------
    # set by _install_ops (the op layer sits above this module, so it hands these over instead of being
    # imported): torch function -> dtorch op routing, and the dtype cast behind .to(dtype)
    _torch_function = None
    _cast = None
    _installed: dict = {}  # attribute name -> op name, of every attribute _install_ops bound

    @classmethod
    def _install_ops(cls, table, *, torch_function, cast, missing_attribute) -> None:
        """Bind every op's Tensor attributes (``Op.methods``: a name binds the op's function as a method,
        ``(name, value)`` binds ``value``, e.g. a dunder or a property), the torch-function router, the
        dtype cast of ``.to`` and the helpful ``__getattr__`` for torch attributes dtorch lacks."""
        for op in table.values():
            for m in op.methods:
                attr, value = (m, op.fn) if isinstance(m, str) else m
                owner = cls._installed.get(attr)
                if (owner is not None and owner != op.name) or (owner is None and attr in cls.__dict__):
                    raise RuntimeError(f"Tensor.{attr}: op {op.name!r} binds it, but "
                                       f"{'op ' + repr(owner) if owner else 'tensor.py'} already defines it")
                setattr(cls, attr, value)
                cls._installed[attr] = op.name
        cls._torch_function = staticmethod(torch_function)
        cls._cast = staticmethod(cast)
        cls.__getattr__ = missing_attribute


register_tensor_type(Tensor)  # get_memory_stats counts live tensors
# the slot itself: an unset slot read through it raises AttributeError at once (a plain read of one would go
# through Tensor.__getattr__, the helpful message for torch attributes dtorch lacks: microseconds)
_get_writes = Tensor.__dict__["_writes"].__get__


def _constructor_data(args: tuple, dtype, graph: Graph):
    """The data of ``Tensor(*args)``: the one data argument, or a zero tensor of torch's size forms."""
    if len(args) == 1 and not isinstance(args[0], torch.Size):
        return args[0]
    if len(args) == 1:
        size = tuple(args[0])
    elif all(isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in args):
        size = tuple(int(a) for a in args)  # () too: Tensor() is an empty [0] tensor, as in torch
        size = size if args else (0,)
    else:
        raise TypeError(
            f"dtorch.Tensor() takes one data argument (a tensor, a number, a nested list or a numpy array) or sizes "
            f"(ints or a torch.Size), got {len(args)} arguments of types {[type(a).__name__ for a in args]}; wrap "
            "several values in a list: dtorch.Tensor([1, 2, 3])")
    if any(s < 0 for s in size):
        raise ValueError(f"dtorch.Tensor(): sizes must be non-negative, got {list(size)}")
    return torch.zeros(size, dtype=dtype or graph.default_dtype)


def as_torch(data, dtype: torch.dtype | None, graph: Graph) -> torch.Tensor:
    """Turn user data (torch tensor, number, nested list, numpy array) into a fresh torch tensor."""
    if isinstance(data, torch.Tensor):
        out = data.detach()
        out = out.to(dtype) if dtype is not None and dtype != out.dtype else out
        return out.clone() if out.data_ptr() == data.data_ptr() or out is data else out
    if isinstance(data, np.ndarray):
        try:
            out = torch.from_numpy(np.array(data))
        except TypeError:
            raise TypeError(
                f"cannot build a dtorch.Tensor from a numpy array of dtype {data.dtype}; convert it to a numeric "
                "or bool dtype first (e.g. arr.astype(np.float32))"
            ) from None
        return out.to(dtype) if dtype is not None else out
    if isinstance(data, (bool, numbers.Number, list, tuple)):
        try:
            if dtype is None and _has_float(data):
                dtype = graph.default_dtype
            return torch.tensor(data, dtype=dtype)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"cannot build a dtorch.Tensor from {type(data).__name__} data: {exc}") from None
    raise TypeError(
        f"cannot build a dtorch.Tensor from {type(data).__name__}; pass a torch.Tensor, a dtorch.Tensor, "
        "a number, a numpy array or a nested list of numbers"
    )


def _has_float(data) -> bool:
    if isinstance(data, (list, tuple)):
        return any(_has_float(d) for d in data)
    return isinstance(data, float)

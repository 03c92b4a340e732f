"""Creation ops: ``zeros ones empty full rand randn randint arange`` and their ``*_like`` forms.

Values are made once, globally, by torch (so random values equal torch's for the same generator
whatever the mesh), then each device takes its block.
"""
from __future__ import annotations

import torch

from ..errors import MeshError
from ..graph import Graph, resolve_graph
from ..mesh import DeviceMesh
from ..placement import normalize_placements
from ..spec import DTensorSpec
from ..tensor import Tensor
from .table import register


def mesh_for_device(device) -> DeviceMesh:
    """A one-device mesh for a torch-style device ("cpu", "cuda", "cuda:1", torch.device)."""
    d = torch.device(device)
    return DeviceMesh(d.type, [d.index or 0])


def _resolve_mesh(device_mesh, device) -> DeviceMesh:
    if device_mesh is not None and device is not None:
        raise MeshError("pass either device_mesh or device, not both")
    if device is not None:
        return mesh_for_device(device)
    return Graph.default_graph().default_device_mesh if device_mesh is None else device_mesh


def _shape(size) -> tuple:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return tuple(int(s) for s in size)


def _place(full: torch.Tensor, device_mesh, placements, device, requires_grad: bool = False, graph=None) -> Tensor:
    mesh = _resolve_mesh(device_mesh, device)
    graph = resolve_graph(graph)
    spec = DTensorSpec(mesh, normalize_placements(placements, mesh.ndim, full.ndim, mesh.shape), tuple(full.shape), full.dtype)
    out = Tensor._make(spec, graph.runtime.from_global(full, spec), graph)
    return out.requires_grad_() if requires_grad else out  # (torch's error for an integer dtype)


def _float_dtype(dtype):
    return dtype if dtype is not None else Graph.default_graph().default_dtype


def values_device(graph=None) -> str:
    """Where the controller makes a global value to lay out: "meta" on a backend without values (nothing is
    allocated or drawn), else the CPU."""
    return "cpu" if resolve_graph(graph).runtime.holds_values else "meta"


def _factory(name, make):
    def fn(*size, dtype=None, device_mesh=None, placements=None, device=None, generator=None, requires_grad=False,
           graph=None, **kw):
        if "size" in kw:  # torch also takes size=
            if size:
                raise TypeError(f"dtorch.{name}() got sizes both positionally and as size=")
            size = (kw.pop("size"),)
        if kw:
            raise TypeError(f"dtorch.{name}() got unexpected keyword arguments {sorted(kw)}")
        full_t = make(_shape(size), dtype, generator, values_device(graph))
        return _place(full_t, device_mesh, placements, device, requires_grad, graph)

    fn.__name__ = name
    fn.__doc__ = f"``torch.{name}`` laid out on ``device_mesh`` with ``placements`` (default: all Replicate)."
    return register(name)(fn)


zeros = _factory("zeros", lambda s, dt, g, dev: torch.zeros(s, dtype=_float_dtype(dt), device=dev))
ones = _factory("ones", lambda s, dt, g, dev: torch.ones(s, dtype=_float_dtype(dt), device=dev))
empty = _factory("empty", lambda s, dt, g, dev: torch.zeros(s, dtype=_float_dtype(dt), device=dev))
# (the meta device draws nothing: the generator is left as it is)
rand = _factory("rand", lambda s, dt, g, dev: torch.rand(s, dtype=_float_dtype(dt), generator=g if dev == "cpu" else None,
                                                         device=dev))
randn = _factory("randn", lambda s, dt, g, dev: torch.randn(s, dtype=_float_dtype(dt),
                                                           generator=g if dev == "cpu" else None, device=dev))


@register()
def full(size, fill_value, *, dtype=None, device_mesh=None, placements=None, device=None, requires_grad=False,
         graph=None):
    if dtype is None and isinstance(fill_value, float):
        dtype = _float_dtype(None)
    return _place(torch.full(_shape((size,)), fill_value, dtype=dtype, device=values_device(graph)), device_mesh,
                  placements, device, requires_grad, graph)


@register()
def randint(low, high=None, size=None, *, dtype=None, device_mesh=None, placements=None, device=None, generator=None,
            requires_grad=False, graph=None):
    if size is None:  # randint(high, size)
        low, high, size = 0, low, high
    full_t = torch.randint(low, high, _shape((size,)), dtype=dtype or torch.int64, generator=generator)
    return _place(full_t, device_mesh, placements, device, requires_grad, graph)


@register()
def arange(start, end=None, step=1, *, dtype=None, device_mesh=None, placements=None, device=None,
           requires_grad=False, graph=None):
    full_t = torch.arange(start, end, step, dtype=dtype) if end is not None else torch.arange(start, dtype=dtype)
    if dtype is None and full_t.dtype.is_floating_point:
        full_t = full_t.to(_float_dtype(None))
    return _place(full_t, device_mesh, placements, device, requires_grad, graph)


def _like_layout(input: Tensor, device_mesh, placements, device):
    """Mesh and placements of a ``*_like`` result: the input's unless a mesh or device is given."""
    if device is not None:
        return _resolve_mesh(device_mesh, device), placements
    mesh = device_mesh or input.device_mesh
    if placements is None:
        placements = input.placements if mesh == input.device_mesh else None
    return mesh, placements


def _like(name, base):
    def fn(input: Tensor, *args, dtype=None, device_mesh=None, placements=None, device=None, **kwargs):
        mesh, placements = _like_layout(input, device_mesh, placements, device)
        return base(*args, input.shape, dtype=dtype or input.dtype, device_mesh=mesh, placements=placements, **kwargs) \
            if name != "full_like" else base(input.shape, *args, dtype=dtype or input.dtype, device_mesh=mesh,
                                             placements=placements, **kwargs)

    fn.__name__ = name
    return register(name, torch_fns=(getattr(torch, name),))(fn)  # torch.zeros_like(dtensor) too


zeros_like = _like("zeros_like", zeros)
ones_like = _like("ones_like", ones)
empty_like = _like("empty_like", empty)
rand_like = _like("rand_like", rand)
randn_like = _like("randn_like", randn)
full_like = _like("full_like", full)


@register(torch_fns=(torch.randint_like,))
def randint_like(input: Tensor, low, high=None, *, dtype=None, device_mesh=None, placements=None, device=None,
                 generator=None, requires_grad=False, graph=None):
    mesh, placements = _like_layout(input, device_mesh, placements, device)
    if high is None:
        low, high = 0, low
    return randint(low, high, tuple(input.shape), dtype=dtype or input.dtype, device_mesh=mesh, placements=placements,
                   generator=generator, requires_grad=requires_grad, graph=graph)


def _new_leaf(data, device_mesh, placements, dtype, requires_grad, graph=None) -> Tensor:
    # a new leaf, like torch.tensor: a torch or dtorch tensor given as data brings its value, not its history
    if isinstance(data, torch.Tensor):
        data = data.detach()
    elif isinstance(data, Tensor) and data.requires_grad:
        data = data.detach()
    out = Tensor(data, device_mesh=device_mesh, placements=placements, dtype=dtype, graph=graph)
    return out.requires_grad_() if requires_grad else out


@register()
def tensor(data, *, dtype=None, device_mesh=None, placements=None, requires_grad=False, graph=None):
    return _new_leaf(data, device_mesh, placements, dtype, requires_grad, graph)


@register()
def from_torch(data, *, device_mesh=None, placements=None, dtype=None, requires_grad=False, graph=None):
    return _new_leaf(data, device_mesh, placements, dtype, requires_grad, graph)



# -- x.new_*: new tensors with x's dtype on x's mesh (Replicate), as torch's methods make them on x's device --

def _new_layout(self: Tensor, device, dtype):
    mesh = _resolve_mesh(None, device) if device is not None else self.device_mesh
    return mesh, dtype or self.dtype


def _new_factory(name: str, base):
    def method(self: Tensor, *size, dtype=None, device=None, requires_grad=False, **kw):
        mesh, dtype = _new_layout(self, device, dtype)
        return base(*size, dtype=dtype, device_mesh=mesh, requires_grad=requires_grad, graph=self._graph, **kw)

    method.__name__ = name
    method.__doc__ = f"``torch.Tensor.{name}``: a new Replicate tensor of this tensor's dtype on its mesh."
    return register(name, public=False, methods=(name,))(method)


new_empty = _new_factory("new_empty", empty)
new_zeros = _new_factory("new_zeros", zeros)
new_ones = _new_factory("new_ones", ones)


@register(public=False, methods=("new_full",))
def new_full(self: Tensor, size, fill_value, *, dtype=None, device=None, requires_grad=False) -> Tensor:
    mesh, dtype = _new_layout(self, device, dtype)
    return full(size, fill_value, dtype=dtype, device_mesh=mesh, requires_grad=requires_grad, graph=self._graph)


@register(public=False, methods=("new_tensor",))
def new_tensor(self: Tensor, data, *, dtype=None, device=None, requires_grad=False) -> Tensor:
    """``torch.Tensor.new_tensor``: ``data`` copied into a new leaf of this tensor's dtype (unless ``dtype``)."""
    mesh, dtype = _new_layout(self, device, dtype)
    return _new_leaf(data, mesh, None, dtype, requires_grad, self._graph)

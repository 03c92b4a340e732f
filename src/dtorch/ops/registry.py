"""The one operator registry and the dispatch path every op takes.

An op call is: specs of the tensor inputs + hashable static arguments -> ``OpPlan`` (computed once by
the op family's rule, then a dict lookup) -> redistribute the inputs the plan asks to move -> run the
plan's kernel on every device -> wrap the outputs. Rules see specs only, never data.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import DTorchError, OpError
from ..graph import check_one_graph
from ..placement import Replicate
from ..redistribute import redistribute_spec
from ..runtime.kernels import Kernel
from ..spec import DTensorSpec
from ..tensor import Tensor, as_torch

# public name -> function (exported as dtorch.<name>); torch function -> dtorch function
PUBLIC: dict[str, Callable] = {}
FUNCTIONAL: dict[str, Callable] = {}
TORCH_FUNCTIONS: dict[Callable, Callable] = {}


@dataclass(frozen=True)
class OpPlan:
    in_specs: tuple  # the spec each tensor input must have (same mesh, shape, dtype; maybe other placements)
    out_specs: tuple
    kernel: Kernel
    kwargs: dict = field(default_factory=dict)
    device_args: dict | None = None  # name -> numpy array over the mesh shape (per-device values)
    multi_output: bool = False


_PLANS: dict = {}
stats = {"plan_hits": 0, "plan_misses": 0}


def register(name: str | None = None, *, methods=(), torch_fns=(), functional: bool = False, public: bool = True):
    """Expose ``fn`` as ``dtorch.<name>``, as Tensor methods, and as the target of torch functions."""

    def deco(fn):
        n = name or fn.__name__
        if public:
            PUBLIC[n] = fn
        if functional:
            FUNCTIONAL[n] = fn
        for m in methods:
            setattr(Tensor, m, fn)
        for tf in torch_fns:
            TORCH_FUNCTIONS[tf] = fn
        return fn

    return deco


def dispatch(name: str, rule: Callable, tensors, static: tuple = ()):
    """Run op ``name`` on dtorch tensors; ``rule(specs, *static) -> OpPlan``."""
    graph = tensors[0]._graph
    for t in tensors:
        if t._graph is not graph:  # plans are cached by specs alone: the graphs are checked on every call
            check_one_graph(name, tensors)
            break
    specs = tuple(t._spec for t in tensors)
    key = (name, specs, static)
    plan = _PLANS.get(key)
    if plan is None:
        stats["plan_misses"] += 1
        plan = _PLANS[key] = make_plan(name, rule, specs, static)
    else:
        stats["plan_hits"] += 1
    ins = [t if t._spec == s else redistribute_spec(t, s) for t, s in zip(tensors, plan.in_specs)]
    try:
        handles = graph.runtime.run_local(plan.kernel, [t._h for t in ins], plan.in_specs, plan.out_specs,
                                          plan.kwargs, plan.device_args)
    except DTorchError:
        raise
    except Exception as exc:
        raise OpError(f"dtorch.{name} failed on inputs {describe(specs)}: {type(exc).__name__}: {exc}") from exc
    make = Tensor._make
    if plan.multi_output:
        return tuple(make(s, h, graph) for s, h in zip(plan.out_specs, handles))
    return make(plan.out_specs[0], handles[0], graph)


def make_plan(name, rule, specs, static) -> OpPlan:
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != mesh:
            raise OpError(
                f"dtorch.{name}: inputs live on different meshes ({mesh!r} and {s.mesh!r}); "
                "redistribute one onto the other's mesh first, e.g. x.redistribute(device_mesh=y.device_mesh)"
            )
    try:
        return rule(specs, *static)
    except DTorchError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise OpError(f"dtorch.{name} cannot run on inputs {describe(specs)}: {exc}") from exc


def describe(specs) -> str:
    return "; ".join(f"#{n}: {s}" for n, s in enumerate(specs))


def placement_error(name: str, specs, accepted: str) -> OpError:
    return OpError(f"dtorch.{name} does not accept inputs {describe(specs)}; it accepts {accepted}")


# ------------------------------------------------------------------------------------------------
# helpers shared by the op families


def spec_like(spec: DTensorSpec, *, placements=None, shape=None, dtype=None) -> DTensorSpec:
    return DTensorSpec(spec.mesh, tuple(placements) if placements is not None else spec.placements,
                       tuple(shape) if shape is not None else spec.shape, dtype if dtype is not None else spec.dtype)


def replicated(spec: DTensorSpec) -> DTensorSpec:
    return spec_like(spec, placements=(Replicate(),) * spec.mesh.ndim)


def meta_call(fn: Callable, specs, *args, **kwargs):
    """Run a torch function on meta tensors of ``specs``' global shapes: output shapes and dtypes, no data."""
    metas = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in specs]
    return fn(*metas, *args, **kwargs)


def to_dtensors(name: str, args, mesh_from=None) -> list:
    """dtorch tensors among ``args``; torch tensors become Replicate dtorch tensors on the same mesh,
    in the first dtorch tensor's Graph (which need not be this thread's default)."""
    first = next((a for a in args if isinstance(a, Tensor)), None)
    mesh = mesh_from if mesh_from is not None or first is None else first.device_mesh
    out = []
    for a in args:
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, torch.Tensor):
            if first is None:
                out.append(Tensor(a, device_mesh=mesh))
            else:
                graph = first._graph
                full = as_torch(a, None, graph)
                spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(full.shape), full.dtype)
                out.append(Tensor._make(spec, graph.runtime.from_global(full, spec), graph))
        else:
            out.append(a)
    return out


def static_value(v):
    """A hashable stand-in for a static argument (slices, lists) that keeps types apart (1 vs True vs 1.0)."""
    if isinstance(v, slice):
        return ("slice", v.start, v.stop, v.step)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(static_value(x) for x in v)
    if isinstance(v, bool) or isinstance(v, (int, float, complex)):
        return (type(v).__name__, v)
    return v


def torch_function_dispatch(func, args, kwargs):
    target = TORCH_FUNCTIONS.get(func)
    if target is None:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise NotImplementedError(
            f"{getattr(func, '__module__', 'torch')}.{name} is not supported on dtorch tensors; "
            "use the dtorch operator of the same name, or convert with .to_torch()"
        )
    return target(*args, **kwargs)


def resolve_torch(path: str) -> Callable:
    """'torch.add' / 'F.gelu' / 'Tensor.to' -> the torch callable (kernels carry names, not functions)."""
    fn = _RESOLVED.get(path)
    if fn is None:
        root, _, rest = path.partition(".")
        obj = {"torch": torch, "F": torch.nn.functional, "Tensor": torch.Tensor, "special": torch.special}[root]
        for part in rest.split("."):
            obj = getattr(obj, part)
        fn = _RESOLVED[path] = obj
    return fn


_RESOLVED: dict = {}

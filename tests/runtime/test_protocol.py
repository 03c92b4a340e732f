"""The worker protocol and the transport seam: records tagged with their type, a handler per record type, and a ray backend
that is the process backend's controller over another transport (no private method overridden)."""
from __future__ import annotations

import inspect
import pickle

import pytest
import torch

from dtorch.runtime import protocol as rec
from dtorch.runtime.process import ProcessRuntime
from dtorch.runtime.transport import Transport
from dtorch.runtime.worker_loop import Worker


def test_every_record_type_has_exactly_its_handler():
    assert set(Worker.HANDLERS) == set(rec.RECORD_TYPES)
    for record_type, fn in Worker.HANDLERS.items():
        assert fn.handles is record_type
        # a handler takes the record, nothing else: its fields cannot drift from the sender's
        assert list(inspect.signature(fn).parameters) == ["self", "r"], fn.__qualname__


def test_a_type_without_handler_is_named():
    class Partial(Worker):
        pass

    Partial.on_kernel = lambda self, r: None  # unmarked: not a handler
    assert rec.handler_table(Partial)[rec.Kernel] is Worker.on_kernel

    class Bare:
        @rec.handles(rec.Kernel)
        def on_kernel(self, r):
            pass

    with pytest.raises(TypeError, match="handles no .*Put"):
        rec.handler_table(Bare)


def test_records_are_tagged_tuples_checked_like_calls():
    k = rec.Kernel(7, 3, (1, 2), (5,), {"dim": -1}, None)
    assert k == (rec.Kernel, 7, 3, (1, 2), (5,), {"dim": -1}, None) and type(k) is tuple
    assert rec.Kernel.fields == ("seq", "pid", "in_ids", "out_ids", "kwargs", "dev_kw")
    assert rec.Get(4, 5, 6) == (rec.Get, 4, 5, 6, False, 0)  # defaults
    assert rec.Exit() == (rec.Exit,)
    with pytest.raises(TypeError, match=r"Kernel\(\) missing 1 required positional argument: 'dev_kw'"):
        rec.Kernel(7, 3, (1, 2), (5,), {})
    with pytest.raises(TypeError, match="unexpected keyword argument 'sequence'"):
        rec.Zeros(sequence=1, hid=2, dtype=torch.float32, shape=(3,), device_type="cpu")
    records = [k, rec.Put(1, 2, torch.float32, (3, 4), "cpu", b"xy"), rec.Exit(), rec.Reform()]
    assert pickle.loads(pickle.dumps(records, protocol=5)) == records


def test_failure_names_the_op_number_of_numbered_records():
    try:
        raise ValueError("boom")
    except ValueError as exc:
        seq, kind, text, tb = rec.failure(rec.Kernel(42, 1, (), (), {}, None), exc)
        assert (seq, kind, text) == (42, "Kernel", "ValueError: boom") and "boom" in tb
        seq, kind, _, _ = rec.failure(rec.Free((3, 4)), exc)
        assert seq is None and kind == "Free (3, 4)"
    assert rec.NUMBERED == {t for t in rec.RECORD_TYPES if "seq" in t.fields}


def test_the_ray_backend_overrides_no_private_method_of_the_process_backend():
    ray_backend = pytest.importorskip("dtorch.runtime.ray_backend")
    methods = {name for name, v in vars(ray_backend.RayRuntime).items()
               if inspect.isfunction(v) or isinstance(v, (staticmethod, classmethod, property))}
    own = {name for name in methods if name.startswith("_") and not (name.startswith("__") and name.endswith("__"))}
    shadowed = sorted(name for name in own if hasattr(ProcessRuntime, name))
    assert shadowed == [], f"RayRuntime overrides private methods of ProcessRuntime: {shadowed}"
    # and what it does define is its construction: the transport carries every difference
    assert methods == {"__init__"}, methods
    assert issubclass(ray_backend.RayTransport, Transport)


def test_the_kernel_records_written_as_tuples_have_the_kernel_fields():
    # process_ops writes the hottest record as its tuple literal: it must stay what the type declares
    import ast

    from dtorch.runtime import process_ops

    tree = ast.parse(inspect.getsource(process_ops))
    literals = [n for n in ast.walk(tree) if isinstance(n, ast.Tuple) and n.elts
                and isinstance(n.elts[0], ast.Name) and n.elts[0].id == "Kernel"]
    assert len(literals) == 2
    for lit in literals:
        assert [getattr(e, "id", None) for e in lit.elts[1:6]] == ["seq", "pid", "in_ids", "out_ids", "kwargs"]
        assert len(lit.elts) == 1 + len(rec.Kernel.fields)



def _unpackings(fn):
    """The name lists of ``a, b, c = r`` statements in ``fn``'s source."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == "r"
                and isinstance(node.targets[0], ast.Tuple)):
            yield [getattr(e, "id", None) for e in node.targets[0].elts]


def test_handlers_and_links_unpack_exactly_the_declared_fields():
    from dtorch.runtime.ray_worker import RayLink
    from dtorch.runtime.worker import StoreLink

    # each record read by unpacking is read whole, in the declared order (a renamed, added or moved field
    # fails here, not on a worker)
    readers = list(Worker.HANDLERS.items()) + [(rec.Put, StoreLink.receive), (rec.Get, StoreLink.send),
                                                (rec.Batch, StoreLink.batch), (rec.Put, RayLink.receive)]
    checked = 0
    for record_type, fn in readers:
        for names in _unpackings(fn):
            assert len(names) == 1 + len(record_type.fields), (fn.__qualname__, names)
            for got, field in zip(names[1:], record_type.fields):
                assert got in ("_", field), (fn.__qualname__, got, field)
            checked += 1
    assert checked >= 15

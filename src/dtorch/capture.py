"""What library code tells a step capture (``dtorch.compile``) about the Python around its kernels.

A capture records what a step dispatches to the runtime and replays it without running the Python again. Most
Python between kernels only decides *which* kernels run, and the capture's guards keep those decisions valid.
Three kinds of Python state are different, and the code that owns them says so here:

* ``effect(fn, *args)``: Python state the step changes (an optimizer's step counter). ``fn(*args)`` runs now
  and again at every replay, at the same point of the step.
* ``live(fn, *args)``: a value computed from such state and handed to a kernel (an optimizer's bias corrections,
  a tensor lr read with ``.item()``): ``fn(*args)`` is returned now and recomputed at every replay; a kernel
  keyword argument that is this very object (or a kwargs dict that is) takes the new value.
* ``refuse(reason)``: Python state the replay cannot follow (the KV cache's write position): the function runs
  eagerly every time, and ``dtorch.compile.explain`` prints the reason.

A base-layer module: it imports nothing of dtorch. With no capture running, each call is one global read.
"""
from __future__ import annotations

_recorder = None  # the capture running in this process, else None (set by dtorch.compile while it traces)


def active():
    """The running capture's recorder, else None."""
    return _recorder


def set_active(recorder) -> None:
    global _recorder
    _recorder = recorder


def effect(fn, *args) -> None:
    """Run ``fn(*args)`` (a change of Python state the step makes); a capture runs it again at each replay."""
    if _recorder is None:
        fn(*args)
    else:
        _recorder.note_effect(fn, args)


def live(fn, *args):
    """``fn(*args)``, recomputed at each replay wherever the value reaches a kernel (module doc)."""
    if _recorder is None:
        return fn(*args)
    return _recorder.note_live(fn, args)


def refuse(reason: str) -> None:
    """The running capture (if any) cannot replay this step: ``reason`` says why, in the user's terms."""
    if _recorder is not None:
        _recorder.note_refusal(reason)

"""Python's cyclic garbage collector paused over a training step's calls (a forward, a backward walk, a
pipeline schedule, a compiled step).

A step makes and frees thousands of small Python objects per op (autograd nodes, tapes, specs). They are
freed by reference counting: a step leaves no cyclic garbage (counted with ``gc.callbacks`` on the Llama
steps of bench/train_matrix.py: 0 objects collected per step). But the objects that live from the forward
to the backward survive young collections and are promoted, and the promotions trigger full collections,
which scan every object of the process: with torch and transformers loaded (about 370,000 objects), 0.3 s
each, charged to the training step every few steps (the pp2 1F1B step: 32 young and 0.3 full collections
per step, 0.04-0.1 s of its 1.6-3 s). With the collector paused over the call, what the call made and
freed is never scanned; what survives it is left to the collector as before. A user's cyclic garbage made
inside such a call is collected at the first collection after it.

Re-entrant: a call inside a paused call leaves the collector as it finds it, and a collector the user
disabled stays disabled.

Not while a graph measures memory (``Graph.track_memory``): its accounting counts a block free when its
handle dies, and some handles die in cycles (a model's modules and their fsdp units), so a pause moves those
frees and changes the figures (``dtorch plan``'s gathered-weight bytes came out negative). Measuring runs as
before the pause; speed is not what it measures.
"""
from __future__ import annotations

import functools
import gc
import weakref

measuring = weakref.WeakSet()  # the graphs that track memory now (Graph.track_memory)


def collector_paused(fn):
    """``fn`` with the cyclic collector paused over its call (see the module doc)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if measuring or not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()
    return call

"""The one bounded cache every process-global cache of dtorch uses (plans, executables, memos).

A cache keyed by shapes grows without end in a loop whose shapes change every step (decoding one
token at a time), so none may be a plain dict. ``LRU`` keeps at most ``maxsize`` entries and drops
those not used lately.

It keeps two generations instead of a linked list, so that a hit in the steady state costs one dict
lookup (``cache.fast_get(key)`` on hot paths, falling back to ``cache.get(key)`` when it returns
None): new entries go to the recent generation; when that holds ``maxsize // 2`` entries they become
the old generation and the previous old one is dropped; a hit in the old generation moves the entry
back to the recent one. An entry used at least once per ``maxsize // 2`` insertions is therefore never
dropped, and the size never exceeds ``maxsize``.

``on_evict(dropped)``, if given, is called with the dict of the entries dropped to make room (a whole
old generation at once), before the new entry goes in: a cache whose entries stand for state held
elsewhere (the process backend's plan ids, defined on its workers) releases that state there.
``clear()`` does not call it.
"""
from __future__ import annotations

import weakref

_MISSING = object()
_ALL: "weakref.WeakSet[LRU]" = weakref.WeakSet()


class LRU:
    __slots__ = ("name", "maxsize", "on_evict", "_recent", "_old", "fast_get", "__weakref__")

    def __init__(self, name: str, maxsize: int, on_evict=None):
        if maxsize < 2:
            raise ValueError(f"LRU {name!r}: maxsize must be at least 2, got {maxsize}")
        self.name = name
        self.maxsize = maxsize
        self.on_evict = on_evict
        self._recent: dict = {}  # the same dict object for the cache's life: fast_get is its bound get
        self._old: dict = {}
        self.fast_get = self._recent.get
        _ALL.add(self)

    def get(self, key, default=None):
        value = self._recent.get(key, _MISSING)
        if value is not _MISSING:
            return value
        value = self._old.pop(key, _MISSING)
        if value is _MISSING:
            return default
        self[key] = value
        return value

    def __setitem__(self, key, value) -> None:
        recent = self._recent
        if key not in recent:
            self._old.pop(key, None)  # a key lives in one generation; it is not dropped below
            if len(recent) >= self.maxsize // 2:
                dropped, self._old = self._old, dict(recent)
                recent.clear()
                if dropped and self.on_evict is not None:
                    self.on_evict(dropped)
        recent[key] = value

    def __contains__(self, key) -> bool:
        return key in self._recent or key in self._old

    def __len__(self) -> int:
        return len(self._recent) + len(self._old)

    def items(self):
        return list(self._old.items()) + list(self._recent.items())

    def values(self):
        return list(self._old.values()) + list(self._recent.values())

    def clear(self) -> None:
        self._recent.clear()
        self._old = {}

    def __repr__(self):
        return f"LRU({self.name!r}, {len(self)}/{self.maxsize})"


def all_caches() -> list[LRU]:
    """Every live LRU (the bounded-cache tests walk them)."""
    return sorted(_ALL, key=lambda c: c.name)

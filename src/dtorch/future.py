"""TensorFuture: a value the runtime will deliver (``to_torch_async``)."""
from __future__ import annotations

import concurrent.futures
from typing import Callable


class TensorFuture:
    def __init__(self, future: concurrent.futures.Future, describe: str = "tensor"):
        self._future = future
        self._describe = describe

    @classmethod
    def completed(cls, value) -> "TensorFuture":
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_result(value)
        return cls(f)

    @classmethod
    def from_callable(cls, fn: Callable, executor) -> "TensorFuture":
        return cls(executor.submit(fn))

    def is_ready(self) -> bool:
        return self._future.done()

    def wait_for(self, timeout_ms: float) -> bool:
        """Wait up to ``timeout_ms``; True if the value is ready."""
        concurrent.futures.wait([self._future], timeout=timeout_ms / 1000.0)
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        self.get(timeout)

    def get(self, timeout: float | None = None):
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self._describe} was not ready after {timeout} s") from None

    def __await__(self):
        import asyncio

        return asyncio.wrap_future(self._future).__await__()


class VoidFutureCollect(TensorFuture):
    """A future with no value (``Graph.sync_future()``, the original DTorch's name): ``get()`` returns None
    once the work it stands for is done; ``wait``, ``is_ready`` and ``await`` as for ``TensorFuture``."""

    @classmethod
    def completed(cls, value=None) -> "VoidFutureCollect":
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_result(None)
        return cls(f, "sync")

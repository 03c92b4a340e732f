"""dtorch.compile on the process and ray backends: the replay runs the recorded runtime calls on the workers and
gives the eager step's bits (losses of the steps and the final weights of a dp2 x tp2 Llama with AdamW)."""
from __future__ import annotations

import pytest

from tests.compile.test_compile_llama import check_compiled_equals_eager
from tests.models.test_llama import Layout

from .conftest import using

LAYOUT = Layout("dp2 x tp2", (("dp", 2), ("tp", 2)), batch=3, seq=5)


def test_compiled_training_equals_eager_on_the_process_backend(process_pool):
    with using(process_pool):
        check_compiled_equals_eager(LAYOUT, LAYOUT.mesh(), steps=5)


@pytest.mark.slow
def test_compiled_training_equals_eager_on_the_ray_backend(ray_pool):
    with using(ray_pool):
        check_compiled_equals_eager(LAYOUT, LAYOUT.mesh(), steps=5)

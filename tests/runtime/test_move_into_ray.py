"""``Runtime.move_into`` on the ray backend: test_move_into.py's backend tests with ``proc`` bound to a ray Graph
(the ray backend runs the process backend's worker code with Ray's transport)."""
from __future__ import annotations

import pytest

from .test_move_into import (  # noqa: F401  (collected here, on Ray)
    test_copy_on_write_keeps_other_holders_unchanged, test_many_pairs_one_call_per_bucket,
    test_partial_sources_are_reduced_first_and_dtypes_cast, test_targets_used_before_they_are_read,
    test_values_land_in_the_target_in_its_layout)


PROC_BACKEND = "ray"  # the ``proc`` fixture (conftest.py) is the ray backend's session Graph


@pytest.fixture
def graph(proc):
    return proc

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    parser.addoption(
        "--backend", default=None,
        help="run the tests on this dtorch backend (a name in dtorch.runtime.registry.BACKENDS, e.g. 'reference'): "
             "every Graph made without backend=, the default Graphs included, uses it (sets DTORCH_BACKEND)")


def pytest_configure(config):
    backend = config.getoption("--backend")
    if backend:
        from dtorch.runtime.registry import check_backend

        check_backend(backend, " (pytest --backend)")
        os.environ["DTORCH_BACKEND"] = backend  # read by every Graph() made without backend=


def pytest_report_header(config):
    return f"dtorch backend: {os.environ.get('DTORCH_BACKEND') or 'inprocess'}"


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny kernels: on a shared machine torch's spinning thread pool makes
    them up to 10x slower and erratic (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

import os
import sys

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

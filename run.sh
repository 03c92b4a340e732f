#!/usr/bin/env bash
# Set up .venv with the pinned dependencies, then run the demo or the tests.
#   ./run.sh demo [args]   the main job: the parallel demo on simulated CPU devices
#   ./run.sh test [args]   the test suite
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import dtorch, pytest, hypothesis, importlib.util as u; assert u.find_spec('ray') and u.find_spec('matplotlib')" >/dev/null 2>&1 || [ pyproject.toml -nt .venv/.installed ]; then
  # the ray extra too: the tests run the ray backend against a local Ray; the plot extra: dtorch train --plot
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,ray,plot]"
  touch .venv/.installed
fi
cmd=${1:-demo}
shift || true
case "$cmd" in
  demo) exec .venv/bin/python -m dtorch.cli demo "$@" ;;
  test) exec .venv/bin/python -m pytest -q "$@" ;;
  *) echo "usage: ./run.sh demo|test [args]" >&2; exit 2 ;;
esac

#!/bin/bash
# The GPU machine's check, as one call of the device tool: `bash tests/gpu/device-check.sh`, carrying .whl.
#
# Its image has torch with CUDA but not the Jupyter stack: first, here, fetch the wheels (Python 3.12):
#   echo /.whl/ >> .git/info/exclude
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl anywidget asttokens comm debugpy \
#     decorator executing ipykernel ipython ipython_pygments_lexers ipywidgets jedi jupyter_client jupyter_core \
#     jupyterlab_widgets matplotlib-inline parso pexpect platformdirs prompt_toolkit psygnal ptyprocess pure_eval \
#     pytest-timeout pyzmq stack-data tornado traitlets wcwidth widgetsnbextension \
#     jsonschema jsonschema-specifications referencing rpds-py optuna alembic sqlalchemy colorlog mako greenlet
# (the versions of this venv's `pip list`; nbformat needs jsonschema for the quickstart notebook's test, and
# the GPU search test needs optuna). It ends itself within BUDGET seconds (default 540) and writes
# tests.log and bench.log under $OUT.
set -u
cd "$(dirname "$0")/../.."
budget=${BUDGET:-540}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"
python3 -c "import taas_magic, ipykernel, anywidget" || exit 1
# -W default: a warning of the image's own torch release is shown, not made a failure of every test
python3 -m pytest -p no:cacheprovider -v --tb=short --timeout 120 --session-timeout $((budget * 3 / 5)) -W default \
  -o addopts="-ra --durations=30" tests/gpu > "$OUT/tests.log" 2>&1
echo "pytest rc $? at $SECONDS s"; grep -E " (PASSED|FAILED|SKIPPED|ERROR)|passed|failed" "$OUT/tests.log" | tail -40
timeout -k 5 120 python3 tests/gpu/ipc_counts.py  # the open question of test_memory_gpu.py (docs/development.md)
timeout -k 5 $((budget - SECONDS)) python3 bench/gpu.py --repeats 1 --steps 30 --settle 2 > "$OUT/bench.log" 2>&1
echo "bench rc $? at $SECONDS s"; cat "$OUT/bench.log"

#!/usr/bin/env bash
# The Python package's GPU tests (client/python/tests/gpu: the GPU copy paths, vLLM's GPU KV
# cache views, the vLLM connector's worker side with a GPU cache, hybrid groups included) on
# a CUDA host with torch. Run from the repository root with the orbitkv wheel (its
# orbitkv-server runs the tests' Managers) and pytest's wheels in .device-bin/ (git-ignored);
# the log goes to $OUT.
set -u
python3 -m venv --system-site-packages /tmp/okv-venv
/tmp/okv-venv/bin/pip install -q --no-index --no-deps .device-bin/*.whl
# The package's Python as the working tree has it (the wheel brings the native module and the
# binaries; its Python may be a few commits older).
site=$(/tmp/okv-venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp -r client/python/python/orbitkv/. "$site/orbitkv/"
export ORBITKV_SERVER_BIN=/tmp/okv-venv/bin/orbitkv-server
{ nvidia-smi -L; nproc; python3 -V; /tmp/okv-venv/bin/python -c 'import torch; print("torch", torch.__version__)'; } > "$OUT/env.txt" 2>&1
cd client/python/tests
/tmp/okv-venv/bin/python -m pytest -q -p no:cacheprovider gpu/ > "$OUT/pytest-gpu.txt" 2>&1
echo "pytest exit $?" >> "$OUT/pytest-gpu.txt"

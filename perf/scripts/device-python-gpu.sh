#!/usr/bin/env bash
# The Python package's GPU tests (client/python/tests/gpu: the GPU copy paths, vLLM's GPU KV
# cache views, the vLLM connector's worker side with a GPU cache, hybrid groups included) on
# a CUDA host, with the Python that has torch (`python3` on PATH). Run from the repository root
# with the orbitkv wheel (its orbitkv-server runs the tests' Managers) and pytest's wheels in
# .device-bin/ (git-ignored); the log goes to $OUT.
set -u
T=/tmp/okv-site
PIP="python3 -m pip"
python3 -m pip --version >/dev/null 2>&1 || PIP="/usr/bin/python3 -m pip"  # a venv without pip
$PIP install -q --no-index --no-deps --target "$T" .device-bin/*.whl
# The package's Python as the working tree has it (the wheel brings the native module and the
# binaries; its Python may be a few commits older).
cp -r client/python/python/orbitkv/. "$T/orbitkv/"
export ORBITKV_SERVER_BIN=$T/bin/orbitkv-server PYTHONPATH=$T
{ nvidia-smi -L; nproc; python3 -V; python3 -c 'import torch; print("torch", torch.__version__)'; } > "$OUT/env.txt" 2>&1
cd client/python/tests
python3 -m pytest -q -p no:cacheprovider gpu/ > "$OUT/pytest-gpu.txt" 2>&1
echo "pytest exit $?" >> "$OUT/pytest-gpu.txt"

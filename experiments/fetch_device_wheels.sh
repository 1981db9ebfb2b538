#!/usr/bin/env bash
# Downloads, into .whl/ (ignored by git), the wheels of the packages this project needs
# that a GPU host's JAX + CUDA image lacks (pure-Python, a few MB in all), for Python 3.12
# on x86-64, at the versions requirements.txt pins. The device command then installs
# them with `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl`
# and runs with PYTHONPATH=/tmp/site (see experiments/device_check/__main__.py).
# The env section of device_check lists any package still missing there.
set -euo pipefail
cd "$(dirname "$0")/.."
pin() { grep -i "^$1==" requirements.txt | head -1; }
mkdir -p .whl
for name in ml_collections math-verify latex2sympy2_extended antlr4-python3-runtime tensorboardX; do
  spec=$(pin "$name")
  [ -n "$spec" ] || { echo "no pin for $name in requirements.txt" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$spec"
done
ls -la .whl

#!/usr/bin/env bash
# The real sglang package, importable on a CPU machine, for checking configs against it (no GPU, no
# server): its ServerArgs parser, its env registry (sglang.srt.environ) and its source. sglang is
# installed with --no-deps (its own pins pull CUDA torch and ~70 packages), beside a CPU torch and the
# few packages `import sglang.srt.server_args` needs (torch and triton through srt/utils/common.py).
# The venv is cached ($HEISENHUNT_SGLANG_VENV, default ~/.cache/heisenhunt/sglang-<version>-cpu): the first
# run takes about 38 s with uv (67 s with pip alone) and 2.3 GB, later runs return at once.
# Usage: scripts/sglang-cpu.sh   -> prints the venv's python, e.g. for
#   python -m orchestrator -m +experiment=dsv4_corruption deployment=sglang_dsv4 preflight_only=true \
#     ++cluster.hosts.prefill.python=$(scripts/sglang-cpu.sh) ++cluster.hosts.decode.python=$(scripts/sglang-cpu.sh)
set -euo pipefail
# the version conf/deployment/sglang_dsv4.yaml and the `sglang` extra are written for (a test checks all three)
SGLANG_VERSION=0.5.23
VENV="${HEISENHUNT_SGLANG_VENV:-$HOME/.cache/heisenhunt/sglang-$SGLANG_VERSION-cpu}"
PY="${PYTHON:-python3}"
check='import importlib.metadata as m, sglang.srt.server_args, sglang.srt.environ; print(m.version("sglang"))'
if [ -x "$VENV/bin/python" ] && [ "$("$VENV/bin/python" -c "$check" 2>/dev/null)" = "$SGLANG_VERSION" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
echo "installing sglang $SGLANG_VERSION (no deps, CPU torch) into $VENV" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# torch 2.13.0 with pip: a CPU build lies on this project's machines, where pip looks and uv does not
# (uv would take a CUDA build of several GB); elsewhere pip takes PyPI's
"${pip[@]}" torch==2.13.0 >&2
# the rest with uv where it is installed (here 16 s, bytecode compiled, against 45 s with pip), else pip
if "$PY" -m uv --version >/dev/null 2>&1; then
  rest=("$PY" -m uv pip install -q --python "$VENV/bin/python" --compile-bytecode)
else
  rest=("${pip[@]}")
fi
"${rest[@]}" --no-deps "sglang==$SGLANG_VERSION" >&2
"${rest[@]}" triton packaging numpy orjson psutil pybase64 requests pillow starlette msgspec pydantic pyzmq \
  tqdm IPython aiohttp >&2
got=$("$VENV/bin/python" -c "$check")
[ "$got" = "$SGLANG_VERSION" ] || { echo "sglang $got imported, $SGLANG_VERSION expected" >&2; exit 1; }
echo "$VENV/bin/python"

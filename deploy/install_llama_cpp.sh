#!/usr/bin/env bash
# The optional llama.cpp peer of the benchmark (`python -m engine.bench --peers llama.cpp`):
# llama-cpp-python built once for this CPU, its wheel cached, installed from the cache afterwards.
#
#   bash deploy/install_llama_cpp.sh [PYTHON]        # default PYTHON: python3 on PATH
#
# PyPI has only the source of llama-cpp-python, and a plain `pip install llama-cpp-python` builds
# llama.cpp with its multimodal library and every tool (about 11 minutes on 2 cores). Built here
# without them (LLAVA_BUILD=OFF, no tests, examples, tools or server) and with GGML_NATIVE=ON (the
# build llama.cpp recommends for speed: this CPU's own instruction set). The wheel lands in
# $SPECPLAY_CACHE/wheels/<cpu flags hash>/, so a machine with other CPU features (a native build uses
# instructions an older CPU lacks) builds its own, and a second run only installs.
set -euo pipefail
python="${1:-python3}"
version=0.3.36
cache="${SPECPLAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specplay}"
cpu="$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)"
wheels="$cache/wheels/llama-cpp-$cpu"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! ls "$wheels"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
    echo "[llama.cpp] building llama-cpp-python $version for this CPU into $wheels (minutes, once)"
    start=$SECONDS
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$python" -m pip wheel --no-deps -w "$wheels" "llama-cpp-python==$version"
    echo "[llama.cpp] built in $((SECONDS - start)) s"
fi
"$python" -m pip install -q "$wheels"/llama_cpp_python-"$version"-*.whl

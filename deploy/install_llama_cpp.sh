#!/usr/bin/env bash
# The optional llama.cpp peer of the benchmark (`python -m engine.bench --peers llama.cpp`):
# llama-cpp-python built once for this CPU, its wheel cached, installed from the cache afterwards.
#
#   bash deploy/install_llama_cpp.sh [PYTHON]        # default PYTHON: python3 on PATH
#
# PyPI has only the source of llama-cpp-python, and a plain `pip install llama-cpp-python` builds
# llama.cpp with its multimodal library and every tool (about 11 minutes on 2 cores). Built here
# without them (LLAVA_BUILD=OFF, no tests, examples, tools or server) and with GGML_NATIVE=ON (the
# build llama.cpp recommends for speed: this CPU's own instruction set), except on CPUs with AMX
# (below). The wheel lands in $SPECPLAY_CACHE/wheels/<hash of the CPU flags and build>/, so a
# machine with other CPU features (a native build uses instructions an older CPU lacks) builds its
# own, and a second run only installs.
set -euo pipefail
python="${1:-python3}"
version=0.3.36
cache="${SPECPLAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specplay}"
flags="$(grep -m1 '^flags' /proc/cpuinfo)"
build="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
if grep -qw amx_tile <<<"$flags"; then
    # On the Xeons with AMX the native build segfaults as it loads or evaluates the model (seen in
    # session 18; issue 23 saw "Illegal instruction"): build AVX-512 with VNNI and BF16, AMX off.
    isa="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
else
    isa="-DGGML_NATIVE=ON"
fi
cpu="$(printf '%s %s' "$flags" "$isa" | sha256sum | cut -c1-12)"
wheels="$cache/wheels/llama-cpp-$cpu"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! ls "$wheels"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
    echo "[llama.cpp] building llama-cpp-python $version for this CPU into $wheels (minutes, once)"
    start=$SECONDS
    CMAKE_ARGS="$isa $build" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$python" -m pip wheel --no-cache-dir --no-deps -w "$wheels" "llama-cpp-python==$version"
    echo "[llama.cpp] built in $((SECONDS - start)) s"
fi
"$python" -m pip install -q "$wheels"/llama_cpp_python-"$version"-*.whl

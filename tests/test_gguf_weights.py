import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from engine.models.embedded import gguf_path
from engine.models.gguf_weights import hf_config, hf_state_dict, hf_tensors, rope_row_order


def test_rope_row_order_undoes_llama_cpp_interleaving():
    # llama.cpp's converter: w.reshape(heads, 2, dim, ...).swapaxes(1, 2): halves interleaved per head.
    hf = np.arange(2 * 8).reshape(16, 1)
    gguf_rows = hf.reshape(2, 2, 4, 1).swapaxes(1, 2).reshape(16, 1)
    assert (gguf_rows[rope_row_order(16, 2)] == hf).all()
    assert sorted(rope_row_order(16, 2)) == list(range(16))


@pytest.mark.slow
def test_conversion_equals_transformers_gguf_loader_bit_for_bit():
    """Our reader must give exactly what transformers' own GGUF path gives (which needs accelerate
    only for from_pretrained, not for its tensor conversion, called here directly)."""
    path = gguf_path()
    config = hf_config(gguf.GGUFReader(path))
    reference_config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert {k: reference_config[k] for k in config} == config
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    ours = hf_state_dict(path)
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor.float()), name


@pytest.mark.slow
def test_quantised_tensors_keep_their_encoding():
    kinds = {t.name: t.quant_type.name for t in hf_tensors(gguf_path())}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert kinds["model.embed_tokens.weight"] == "Q8_0"
    assert kinds["model.norm.weight"] == "F32"
    assert "lm_head.weight" not in kinds  # tied to the embedding

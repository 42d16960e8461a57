"""The tiny test pair: small random-initialised Llama models with a byte-level tokenizer.

They are written to the cache dir once and loaded back through the same `from_pretrained` path as
every other pair, so tests exercise the real loading code without any download. The draft is the
target's first layer (a layer subset, saved as its own checkpoint), so the two agree often enough
for acceptance to be interesting.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine.models.cache_dir import cache_root
from engine.models.layer_subset import layer_subset_model

TINY_NAME = "tiny-v1"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens plus chat specials; every string round-trips exactly."""
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_pair_dirs() -> tuple[Path, Path]:
    """Return (target_dir, draft_dir), building them on first use (deterministic, seed 0)."""
    root = cache_root() / TINY_NAME
    target_dir, draft_dir = root / "target", root / "draft"
    if (target_dir / "model.safetensors").exists() and (draft_dir / "model.safetensors").exists():
        return target_dir, draft_dir
    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.08,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a wider LM head gives peaked, lower-entropy next-token distributions
        target.lm_head.weight.normal_(0.0, 0.3)
    draft = layer_subset_model(target, [0])
    tmp = Path(tempfile.mkdtemp(dir=cache_root(), prefix=".tiny-"))
    try:
        for model, sub in ((target, "target"), (draft, "draft")):
            model.save_pretrained(tmp / sub, safe_serialization=True)
            tokenizer.save_pretrained(tmp / sub)
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target_dir, draft_dir

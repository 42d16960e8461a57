"""Export the shipped feature draft to a folder vLLM loads as an EAGLE draft (`method: "eagle"`).

Our draft (engine/models/feature_draft.py) computes f̂_j = Norm(Layer(fc([emb(t_j); f_{j-1}]))) with
a full Llama decoder layer (input and post-attention RMSNorm) and a final RMSNorm, and feeds that
post-norm f̂ back as the next input feature. vLLM's `EagleLlamaForCausalLM` (EAGLE-1) drops the
layer's input norm and has no final norm, and `Eagle3LlamaForCausalLM` concatenates separately
normed embedding and feature into a 2H-wide attention input with the residual taken from the
feature alone: neither computes our function. vLLM's `EagleMistralForCausalLM` does, exactly:
`fc(cat(emb, hidden))` -> Mistral (= Llama) decoder layers with both norms -> final RMSNorm, and it
returns the normed state both for the logits and as the next step's feature. So the export is a
one-layer Mistral config (no sliding window, our rope theta) whose weights are ours under vLLM's
names (`eagle_linear` is vLLM's name for fc). The target's embedding and LM head are shared at
load time, as in our engine.

What stock vLLM cannot express is our reduced 16,384-token head: its EAGLE drafts over the full
49,152-token vocabulary, which is our `model-full-vocab` drafter. `--head reduced` writes the
head's token set too and names the plugin's `EagleSpecplayMistralForCausalLM`, which masks the
logits outside it to -inf: our `model` drafter exactly, but loadable only with the plugin.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.models.embedded import embedded_target_dir
from engine.models.registry import DEFAULT_DRAFT_FILE
from engine.peers.vllm_peer import exported_draft_dir
from specplay_vllm.plugin import DRAFT_ARCHITECTURE

HEADS = ("full", "reduced")
_OURS_TO_VLLM = {"fc.weight": "eagle_linear.weight", "model.model.norm.weight": "norm.weight"}


def export_draft(out: Path, head: str = "full", draft_file: Path = DEFAULT_DRAFT_FILE,
                 target_dir: Path | None = None) -> Path:
    """Write config.json + model.safetensors for vLLM's EAGLE loader; returns `out`."""
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    with safe_open(str(draft_file), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != "specplay-feature-draft-v1":
        raise ValueError(f"{draft_file} is not a specplay feature draft")
    state = load_file(str(draft_file))
    vocab_ids = state.pop("vocab_ids").to(torch.int64)
    weights = {}
    for name, tensor in state.items():
        vllm_name = _OURS_TO_VLLM.get(name) or name.removeprefix("model.model.")
        weights[vllm_name] = tensor.float().contiguous()
    num_layers = int(meta["num_layers"])
    target_config = json.loads(((target_dir or embedded_target_dir()) / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id")
    config = {k: target_config[k] for k in keep}
    config.update(
        architectures=[DRAFT_ARCHITECTURE if head == "reduced" else "MistralForCausalLM"],
        model_type="mistral", num_hidden_layers=num_layers, sliding_window=None, tie_word_embeddings=False,
        rope_theta=target_config["rope_parameters"]["rope_theta"], attention_bias=False, torch_dtype="float32",
        specplay={"source": str(draft_file), "head": head, "card": json.loads(meta.get("card", "{}"))
                  .get("description", "")},
    )
    if head == "reduced":
        weights["vocab_ids"] = vocab_ids.sort().values
        config["specplay_head_size"] = int(vocab_ids.numel())
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specplay_vllm.export_draft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default="full", choices=HEADS,
                    help="full: stock vLLM EAGLE (49k head); reduced: our 16k head, needs the plugin")
    ap.add_argument("--out", type=Path, help="output folder (default: under $SPECPLAY_CACHE/vllm)")
    args = ap.parse_args(argv)
    out = export_draft(args.out or exported_draft_dir(args.head), args.head)
    print(out)
    print(f"[export] wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

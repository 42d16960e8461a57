"""Model pairs: the embedded default, the tiny test pair, and any Hugging Face pair by name.

A `ModelPair` holds shared weights and a tokenizer; `make_target()` / `make_drafter()` hand out
fresh per-generation state (KV caches), so several generations can share one loaded pair.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from engine.drafters import Drafter, ModelDrafter, NgramDrafter
from engine.feature_drafter import FeatureDrafter
from engine.models.causal_lm import CausalLM, HFCausalLM
from engine.models.embedded import embedded_target_dir
from engine.models.fast_llama import WEIGHT_DTYPES, FastLlamaCausalLM, fast_backend_supported
from engine.models.feature_draft import FeatureDraft, draft_card, load_feature_draft, rounded_to_q4_1
from engine.models.tiny import tiny_pair_dirs

PAIRS = ("default", "tiny")
# model: the pair's draft (for a feature draft, with its reduced-vocabulary head);
# model-full-vocab: the same feature draft through the target's full LM head (a measured candidate);
# self / self-int8: the target drafting for itself (a sanity check / the quantized self-draft).
DRAFTER_KINDS = ("model", "model-full-vocab", "ngram", "self", "self-int8")
BACKENDS = ("auto", "transformers", "fast")
# The GGUF's own Q4_1 / Q8_0 blocks on our native kernels, against activations rounded to int16 per
# row and group of 32 (exact integer products; VNNI where the CPU has it). The fastest format to
# decode and verify on every CPU measured (Intel Xeon, AVX-512 VNNI: 7.5 against q4_1's 10.8 ms a
# token, 13.1 against 18.1 for 5 rows; its AVX2 build 8.7 against 12.4), at a KL against the float32
# reference of 5.6e-08 (bfloat16: 4.6e-05) and the same greedy tokens (tested). `q4_1` keeps the
# float32 reference bit for bit (fp32 activations) at 1.3-1.4x the time. A model without such blocks
# keeps float32 weights in either. Measured in assets/FAST_BACKEND.md.
DEFAULT_FAST_WEIGHTS = "q4_1_a16"
# A trained draft has no GGUF blocks, so under q4_1(_a16) its layer and fc would keep float32 weights:
# 16.8 MB a draft step for the default pair's draft, a sixth of the target's 96 MB from a thirtieth
# of its layers. A draft needs no reference to match (every rule verifies a token against the D it
# was drawn from, so SpS stays exact for any draft), so they take bfloat16 instead (8.4 MB; its
# panels keep every row's result independent of the batch, which the draft's incremental state
# relies on). A feature draft under q4_1_a16 goes further: its fc, layer and reduced head are
# rounded to the nearest Q4_1 weights and run on the q4_1_a16 kernels (8.5 MB a step, 18.4 before;
# `feature_draft.rounded_to_q4_1`). Its step got 0.6-0.7x as long and end to end, at K = 1, SpS went
# from 1.00x to 1.055x AR and Cactus from 1.05x to 1.11x, for acceptance 0.435 against 0.477 (SpS)
# and 0.547 against 0.574 (Cactus) (assets/FAST_BACKEND.md, session 21). Other drafts' heads keep
# the target's format (its exact Q8_0 blocks under q4_1).
DRAFT_WEIGHTS = {"q4_1": "bfloat16", "q4_1_a16": "bfloat16"}
FEATURE_DRAFT_WEIGHTS = {"q4_1": "bfloat16"}  # under q4_1_a16 it is rounded_to_q4_1, the same format
# The default pair's draft: a feature-level (EAGLE-style) draft distilled from the target by
# `python -m engine.distill`; its model card is assets/DEFAULT_DRAFT.md.
DEFAULT_DRAFT_FILE = Path(__file__).resolve().parents[2] / "assets" / "default_draft.safetensors"
# K with the best measured SpS speed-up for that draft (the K sweep in assets/DEFAULT_DRAFT.md):
# a cheap draft whose later tokens are accepted less often pays off at a small K. K = 1 is best in
# both the int8 and float16 formats since the native kernels (K = 2 had tied on float16 before).
DEFAULT_DRAFT_K = 1
GENERIC_K = 4

hf_logging.disable_progress_bar()  # our own messages say what is loading


@dataclass
class ModelPair:
    name: str
    tokenizer: PreTrainedTokenizerBase
    target_model: PreTrainedModel
    draft_model: PreTrainedModel | None
    draft_description: str
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    feature_draft: FeatureDraft | None = None  # a draft that reads the target's features
    draft_k: int = GENERIC_K  # the K the pair's own draft ("model") works best at

    def recommended_k(self, drafter_kind: str = "model") -> int:
        """The K a new run starts from: the measured best for the pair's own draft, else a generic 4."""
        return self.draft_k if drafter_kind in ("model", "model-full-vocab") else GENERIC_K

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def make_target(self, backend: str = "auto", weight_dtype: str = DEFAULT_FAST_WEIGHTS) -> CausalLM:
        return self._causal_lm(self.target_model, f"{self.name}/target", backend, weight_dtype)

    def make_drafter(self, kind: str = "model", backend: str = "auto",
                     weight_dtype: str = DEFAULT_FAST_WEIGHTS) -> Drafter:
        if kind in ("model", "model-full-vocab") and self.feature_draft is not None:
            draft_dtype = FEATURE_DRAFT_WEIGHTS.get(weight_dtype, weight_dtype)
            draft = rounded_to_q4_1(self.feature_draft) if draft_dtype == "q4_1_a16" else self.feature_draft
            lm = self._causal_lm(draft.model, f"{self.name}/draft", backend, draft_dtype)
            full = kind == "model-full-vocab"
            return FeatureDrafter(draft, lm, self.draft_description + (" (full head)" if full else ""),
                                  self.vocab_size, full_head=full, head_dtype=weight_dtype)
        draft_dtype = draft_weight_dtype(weight_dtype)
        if kind == "model-full-vocab":
            raise ValueError(f"pair {self.name!r} has no feature draft; 'model-full-vocab' needs one")
        if kind == "model":
            if self.draft_model is None:
                raise ValueError(f"pair {self.name!r} has no draft model; use the 'ngram' drafter")
            return ModelDrafter(self._causal_lm(self.draft_model, f"{self.name}/draft", backend, draft_dtype),
                                self.draft_description)
        if kind == "self":
            return ModelDrafter(self._causal_lm(self.target_model, f"{self.name}/target-as-draft", backend,
                                                weight_dtype), "the target itself")
        if kind == "self-int8":
            if backend == "transformers":
                raise ValueError("the int8 self-draft needs the fast backend")
            return ModelDrafter(self._causal_lm(self.target_model, f"{self.name}/target-int8", "fast", "int8"),
                                "the target itself, int8 weights")
        if kind == "ngram":
            return NgramDrafter(self.vocab_size)
        raise ValueError(f"unknown drafter {kind!r}; expected one of {', '.join(DRAFTER_KINDS)}")

    def _causal_lm(self, model: PreTrainedModel, name: str, backend: str, weight_dtype: str) -> CausalLM:
        """`auto` picks the fast static-cache decoder wherever it supports the architecture."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
        supported = fast_backend_supported(model)
        if backend == "fast" and not supported:
            raise ValueError(f"the fast backend does not support {model.config.model_type!r} models; "
                             "use backend='transformers'")
        if backend == "transformers" or not supported:
            return HFCausalLM(model, name, self.vocab_size)
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"unknown weight_dtype {weight_dtype!r}; expected one of {', '.join(WEIGHT_DTYPES)}")
        return FastLlamaCausalLM(model, name, self.vocab_size, weight_dtype=weight_dtype)

    def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
        """Token ids for a user prompt, through the chat template when the tokenizer has one."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the prompt is empty: type some text to continue")
        if chat and self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            return list(ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _eos_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, model.config.eos_token_id,
                   getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return frozenset(ids)


def check_same_vocabulary(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase,
                          target_name: str = "target", draft_name: str = "draft") -> None:
    """Token-level speculative decoding needs one vocabulary: same ids for the same strings."""
    if target_tok.get_vocab() != draft_tok.get_vocab():
        a, b = target_tok.get_vocab(), draft_tok.get_vocab()
        raise ValueError(
            f"the vocabularies of {target_name} ({len(a)} tokens) and {draft_name} ({len(b)} tokens) differ "
            f"({len(set(a.items()) ^ set(b.items()))} mismatched entries); pick a draft from the same model family"
        )


def _load_dir(path: Path | str, **kwargs) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True,
                                                trust_remote_code=False, **kwargs).eval()


def draft_weight_dtype(weight_dtype: str) -> str:
    """The format a trained draft's layers take when the target's weights are in `weight_dtype` (DRAFT_WEIGHTS)."""
    return DRAFT_WEIGHTS.get(weight_dtype, weight_dtype)


@lru_cache(maxsize=4)
def load_pair(name: str = "default", target: str | None = None, draft: str | None = None) -> ModelPair:
    """Load a pair by registry name, or a Hugging Face `target`/`draft` pair by hub name or path."""
    if target is not None:
        return _load_hf_pair(target, draft)
    if name == "tiny":
        target_dir, draft_dir = tiny_pair_dirs()
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        check_same_vocabulary(tokenizer, AutoTokenizer.from_pretrained(draft_dir), "tiny target", "tiny draft")
        target_model = _load_dir(target_dir)
        return ModelPair("tiny", tokenizer, target_model, _load_dir(draft_dir),
                         "tiny random Llama (target's layer 0)", _eos_ids(tokenizer, target_model))
    if name == "default":
        target = load_default_target()
        if not DEFAULT_DRAFT_FILE.exists():
            raise ValueError(f"the default draft {DEFAULT_DRAFT_FILE} is missing; rebuild it with "
                             "`python -m engine.distill data && python -m engine.distill train && "
                             "python -m engine.distill export`")
        draft = load_feature_draft(DEFAULT_DRAFT_FILE, target.target_model)
        description = draft_card(DEFAULT_DRAFT_FILE).get("description", "feature draft")
        return replace(target, name="default", draft_description=description, feature_draft=draft,
                       draft_k=DEFAULT_DRAFT_K)
    raise ValueError(f"unknown pair {name!r}; expected one of {', '.join(PAIRS)}, or give target= and draft=")


@lru_cache(maxsize=1)
def load_default_target() -> ModelPair:
    """The embedded target alone, without a draft: what distillation starts from."""
    target_dir = embedded_target_dir()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target_model = _load_dir(target_dir)
    return ModelPair("default-target", tokenizer, target_model, None, "none", _eos_ids(tokenizer, target_model))


def _load_hf_pair(target: str, draft: str | None) -> ModelPair:
    # Read at call time (huggingface_hub reads its own flag only at import).
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"

    def load(name: str) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
        try:
            return (AutoTokenizer.from_pretrained(name, trust_remote_code=False, local_files_only=offline),
                    _load_dir(name, local_files_only=offline))
        except (OSError, ValueError) as err:
            raise ValueError(
                f"could not load {name!r}: not a local folder and not in the Hugging Face cache"
                + (" (HF_HUB_OFFLINE=1)" if offline else ", and the hub could not be reached")
                + f". Only safetensors checkpoints without remote code are supported. Cause: {err}"
            ) from err

    target_tok, target_model = load(target)
    draft_model = None
    if draft is not None:
        draft_tok, draft_model = load(draft)
        check_same_vocabulary(target_tok, draft_tok, target, draft)
    return ModelPair(f"{target}+{draft or 'ngram'}", target_tok, target_model, draft_model,
                     draft or "none", _eos_ids(target_tok, target_model))


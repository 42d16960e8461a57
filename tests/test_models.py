import pytest
import torch

from engine.detokenize import IncrementalDetokenizer
from engine.models import load_pair
from engine.models.registry import check_same_vocabulary
from engine.models.tiny import byte_tokenizer


def test_tiny_pair_loads_through_from_pretrained(tiny_pair):
    assert tiny_pair.target_model.config.num_hidden_layers == 4
    assert tiny_pair.draft_model.config.num_hidden_layers == 1
    assert tiny_pair.vocab_size == 259
    assert tiny_pair.eos_token_ids == frozenset({tiny_pair.tokenizer.eos_token_id})


def test_kv_rollback_gives_the_same_logits_as_a_fresh_run(tiny_pair):
    prompt = tiny_pair.encode_prompt("roll back")
    lm = tiny_pair.make_target()
    lm.forward(prompt)
    lm.forward([10, 11, 12, 13], last_n=4)
    lm.rollback(len(prompt) + 1)
    after = lm.forward([50, 51], last_n=2)
    fresh = tiny_pair.make_target()
    expected = fresh.forward(prompt + [10, 50, 51], last_n=2)
    assert torch.allclose(after, expected, atol=1e-5)
    with pytest.raises(ValueError):
        lm.rollback(lm.length + 1)


def test_vocabulary_mismatch_is_a_clear_error():
    a = byte_tokenizer()
    b = byte_tokenizer()
    b.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="vocabularies of .* differ"):
        check_same_vocabulary(a, b, "target-x", "draft-y")
    check_same_vocabulary(a, byte_tokenizer())


def test_unknown_pair_and_unreachable_hub_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="unknown pair"):
        load_pair("nope")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not load 'no-such-org/no-such-model'"):
        load_pair("hf", target="no-such-org/no-such-model", draft="no-such-org/no-draft")


def test_unknown_drafter_kind(tiny_pair):
    with pytest.raises(ValueError, match="unknown drafter"):
        tiny_pair.make_drafter("telepathy")


def test_empty_prompt_is_rejected(tiny_pair):
    with pytest.raises(ValueError, match="empty"):
        tiny_pair.encode_prompt("   ")


def test_incremental_detokenizer_keeps_multibyte_characters_whole():
    tok = byte_tokenizer()
    text = "héllo 🙂 wörld"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == text
    assert "" in pieces  # the emoji's first bytes alone are not a character
    assert all("\ufffd" not in p for p in pieces)

"""The feature-level draft: save/load, exactness of SpS with it, and its incremental KV bookkeeping."""

from dataclasses import replace

import pytest
import torch

from engine.config import SpecConfig
from engine.decoding import generate
from engine.events import RoundEvent
from engine.feature_drafter import FeatureDrafter
from engine.models import cpu_kernels
from engine.models.feature_draft import FeatureDraft, draft_card, load_feature_draft
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def feature_pair(tiny_pair, tmp_path_factory):
    """The tiny target with a (random, saved and reloaded) feature draft on a 200-token head."""
    torch.manual_seed(0)
    draft = FeatureDraft(tiny_pair.target_model, torch.randperm(tiny_pair.vocab_size)[:200])
    with torch.no_grad():
        draft.fc.weight.normal_(0, 0.05)
    path = tmp_path_factory.mktemp("draft") / "draft.safetensors"
    draft.save(path, {"description": "tiny feature draft"})
    return replace(tiny_pair, feature_draft=load_feature_draft(path, tiny_pair.target_model),
                   draft_description=draft_card(path)["description"])


def test_saved_draft_reloads_exactly_and_ships_only_its_own_weights(tiny_pair, tmp_path):
    draft = FeatureDraft(tiny_pair.target_model, torch.arange(100))
    path = tmp_path / "d.safetensors"
    draft.save(path, {"description": "x"})
    again = load_feature_draft(path, tiny_pair.target_model)
    for name, value in draft.trainable_state().items():
        assert torch.equal(value.half().float(), again.state_dict()[name]), name  # fp16 on disk
    assert not any("embed_tokens" in k or "lm_head" in k for k in draft.trainable_state())
    assert again.head_weight.data_ptr() == tiny_pair.target_model.lm_head.weight.data_ptr()
    with pytest.raises(ValueError, match="not a feature draft"):
        load_feature_draft(tiny_pair_file(tiny_pair), tiny_pair.target_model)


def tiny_pair_file(pair):
    from engine.models.tiny import tiny_pair_dirs

    return tiny_pair_dirs()[0] / "model.safetensors"


def test_registry_hands_out_the_feature_drafter(feature_pair, backend):
    drafter = feature_pair.make_drafter("model", backend)
    assert isinstance(drafter, FeatureDrafter) and drafter.needs_target_features


@pytest.mark.parametrize("method", ["sps", "cactus"])
def test_greedy_speculative_with_feature_draft_equals_autoregressive(feature_pair, method, backend):
    prompt = feature_pair.encode_prompt("Once upon a time")
    cfg = SpecConfig(method="ar", max_new_tokens=30, temperature=0.0)
    ar = list(generate(feature_pair.make_target(backend), None, feature_pair.tokenizer, prompt, cfg))[-1]
    events = list(generate(feature_pair.make_target(backend), feature_pair.make_drafter("model", backend),
                           feature_pair.tokenizer, prompt, replace(cfg, method=method, num_speculative_tokens=3)))
    assert events[-1].token_ids == ar.token_ids
    assert sum(e.num_draft_tokens for e in events if isinstance(e, RoundEvent)) > 0


def _features(pair, backend, tokens):
    target = pair.make_target(backend)
    target.keep_hidden = True
    target.forward(tokens)
    return target.last_hidden


def test_incremental_state_matches_a_fresh_drafter(feature_pair, backend):
    """After accepting part of a proposal, observing new features and drafting again, the drafter
    proposes exactly what a fresh one given the same context and features proposes; also for a
    context that runs past the known features (an SSD branch)."""
    tokens = feature_pair.encode_prompt("a feature draft test") + [5, 9, 17, 33, 65, 129, 7]
    feats = _features(feature_pair, backend, tokens)
    params = SamplingParams(temperature=0.9)
    u = torch.rand(4)
    a = feature_pair.make_drafter("model", backend)
    a.start()
    a.observe_target(0, feats[:-6])
    a.propose(tokens[:-5], 4, params, u)
    a.observe_target(len(tokens) - 6, feats[-6:-3])  # two of the drafted positions verified
    for context in (tokens[:-2], tokens):  # second: three positions past the known features
        b = feature_pair.make_drafter("model", backend)
        b.start()
        b.observe_target(0, feats[:-3])
        pa, pb = a.propose(context, 4, params, u), b.propose(context, 4, params, u)
        assert pa.tokens == pb.tokens
        torch.testing.assert_close(pa.probs, pb.probs, rtol=1e-4, atol=1e-6)


def test_k_tokens_in_one_call_are_k_calls_of_one_token_right_after_a_prefill(feature_pair, backend):
    """How a draft is cut into calls does not change it. After a prefill the target has computed the
    feature of the context's last token, so the first drawn token's entry reads that feature, not the
    draft's prediction of it, whether the next token is drafted in the same call or in a later one."""
    prompt = feature_pair.encode_prompt("a feature draft test")
    feats = _features(feature_pair, backend, prompt)  # every prompt position, as a prefill leaves them
    params = SamplingParams(temperature=0.9)
    u = torch.rand(3)

    def drafter():
        d = feature_pair.make_drafter("model", backend)
        d.start()
        d.observe_target(0, feats)
        return d

    whole = drafter().propose(prompt, 3, params, u)
    for i in range(3):
        step = drafter().propose(prompt + whole.tokens[:i], 1, params, u[i:i + 1])
        assert step.tokens == whole.tokens[i:i + 1]
        torch.testing.assert_close(step.probs[0], whole.probs[i], rtol=1e-4, atol=1e-6)


def test_reduced_head_gives_zero_probability_outside_its_vocabulary(feature_pair):
    drafter = feature_pair.make_drafter("model")
    tokens = feature_pair.encode_prompt("zero mass outside")
    drafter.start()
    drafter.observe_target(0, _features(feature_pair, "fast", tokens)[:-1])
    probs = drafter.propose(tokens, 3, SamplingParams(temperature=1.0), torch.rand(3)).probs
    outside = torch.ones(feature_pair.vocab_size, dtype=torch.bool)
    outside[feature_pair.feature_draft.vocab_ids] = False
    assert probs[:, outside].sum() == 0 and torch.allclose(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
                                    SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9)],
                         ids=["greedy", "topk-topp", "plain", "topp"])
def test_sampling_over_the_reduced_head_draws_what_the_full_vocabulary_would(feature_pair, params):
    """`_sample` works on V' alone; it must pick the very token (and give the same probabilities)
    as sampling the full-vocabulary logits with -inf outside V'."""
    from engine.sampling import logits_to_probs, sample_from

    drafter = feature_pair.make_drafter("model")
    features = torch.randn(64, feature_pair.target_model.config.hidden_size)
    uniforms = torch.rand(64, generator=torch.Generator().manual_seed(1))
    tokens, probs = drafter._sample(features, params, uniforms)
    full = logits_to_probs(drafter._logits(features), params)
    assert tokens.tolist() == sample_from(full, uniforms).tolist()
    torch.testing.assert_close(probs, full, rtol=1e-5, atol=1e-7)


def test_sps_with_a_reduced_head_draft_samples_the_target_distribution(feature_pair):
    """SpS stays exact although the draft puts zero mass outside V' (first token over many seeds)."""
    from tests.stats import matches

    prompt = feature_pair.encode_prompt("stats")
    target, drafter = feature_pair.make_target(), feature_pair.make_drafter("model")
    firsts, drafted = [], 0
    for seed in range(500):
        cfg = SpecConfig(method="sps", num_speculative_tokens=2, max_new_tokens=3, temperature=1.0, seed=seed)
        events = list(generate(target, drafter, feature_pair.tokenizer, prompt, cfg))
        firsts.append(events[-1].token_ids[0])
        drafted += next(e for e in events if isinstance(e, RoundEvent)).num_draft_tokens
    assert drafted == 2 * 500
    reference = feature_pair.make_target("transformers")
    assert matches(torch.tensor(firsts), torch.softmax(reference.forward(prompt)[-1], dim=-1))


def test_q4_1_a16_draft_runs_on_rounded_blocks_and_leaves_the_shipped_draft_alone(feature_pair):
    """Under q4_1_a16 the GEMMs of the draft step (fc, the layer, the reduced head) find Q4_1 blocks
    (rather than falling back to float32 panels), from a rounded copy that shares the target's embedding and
    head; the loaded draft keeps its own weights, and q4_1 keeps the bfloat16 draft."""
    from engine.models.feature_draft import rounded_to_q4_1
    from engine.models.q4_1_blocks import round_to_q4_1

    if not cpu_kernels.available():
        pytest.skip("the native kernels did not build")
    draft = feature_pair.feature_draft
    drafter = feature_pair.make_drafter("model", "fast", "q4_1_a16")
    layer = drafter.lm.w.layers[0]
    # (the tiny model's down projection reads 172 channels, not whole blocks of 32: it stays float32)
    assert [g.format for g in (drafter.fc, drafter.head, layer.qkv, layer.o, layer.gate_up)] == ["q4_1_a16"] * 5
    twin = rounded_to_q4_1(draft)
    assert twin is rounded_to_q4_1(draft) and not draft.q4_1_rounded
    assert torch.equal(twin.fc.weight, round_to_q4_1(draft.fc.weight)) and not torch.equal(twin.fc.weight, draft.fc.weight)
    assert twin.head_weight is draft.head_weight is feature_pair.target_model.lm_head.weight
    assert feature_pair.make_drafter("model", "fast", "q4_1").lm.weight_dtype == "bfloat16"


def test_default_draft_step_is_all_q4_1_blocks(default_pair):
    """The shipped draft's every GEMM in the default format runs on Q4_1 blocks (8.5 MB a step)."""
    if not cpu_kernels.available():
        pytest.skip("the native kernels did not build")
    drafter = default_pair.make_drafter()
    layer = drafter.lm.w.layers[0]
    gemms = (drafter.fc, drafter.head, layer.qkv, layer.o, layer.gate_up, layer.down)
    assert [g.format for g in gemms] == ["q4_1_a16"] * 6


@pytest.mark.parametrize("weight_dtype", ["float32", "q4_1_a16"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=20, top_p=0.9), SamplingParams()])
def test_one_native_call_per_draft_step_gives_the_same_bits(feature_pair, weight_dtype, params):
    """`FeatureStep` (fc, layer, head and draw in one call) against the same steps one call at a time:
    identical rounds (tokens, their probabilities, accepted lengths) at K = 1 and K = 3."""
    if not cpu_kernels.available():
        pytest.skip("the native kernels did not build")
    target = feature_pair.make_target("fast", weight_dtype)
    fused, plain = (feature_pair.make_drafter("model", "fast", weight_dtype) for _ in range(2))
    assert fused._step is not None
    plain._step = None
    prompt = feature_pair.tokenizer("the cat sat on")["input_ids"]

    def rounds(drafter, k):
        cfg = SpecConfig(method="sps", num_speculative_tokens=k, max_new_tokens=24, temperature=params.temperature,
                         top_k=params.top_k, top_p=params.top_p, seed=3)
        return [(e.draft_token_ids, e.num_accepted, e.num_emitted) if isinstance(e, RoundEvent) else
                (e.token_id, e.draft_prob, e.target_prob)
                for e in generate(target, drafter, feature_pair.tokenizer, prompt, cfg) if hasattr(e, "round_index")]

    for k in (1, 3):
        assert rounds(fused, k) == rounds(plain, k)
    assert fused.lm.num_forwards == plain.lm.num_forwards and fused.lm.length == plain.lm.length


@pytest.mark.parametrize("k", [1, 3])
def test_target_writing_its_features_into_the_drafts_rows_gives_the_same_rounds(feature_pair, k):
    """Where the target's verify is one native call, it writes its hidden states straight into the
    feature draft's rows (`FeatureRows`), growing them (and its own f̂ rows) past their first 256: the same rounds as
    with the states handed over as tensors and copied (`observe_target`)."""
    if not cpu_kernels.available():
        pytest.skip("the native kernels did not build")
    target = feature_pair.make_target("fast", "q4_1_a16")
    direct, handed = (feature_pair.make_drafter("model", "fast", "q4_1_a16") for _ in range(2))
    handed.target_feature_rows = lambda: None
    prompt = feature_pair.tokenizer("the cat sat on " * 15)["input_ids"]
    assert 200 < len(prompt) < 256
    cfg = SpecConfig(method="sps", num_speculative_tokens=k, max_new_tokens=80, temperature=0.8, top_k=20, top_p=0.9,
                     seed=4)
    written = []
    rows_at = direct.rows_at
    direct.rows_at = lambda start, n: written.append(n) or rows_at(start, n)

    def rounds(drafter):
        return [(e.draft_token_ids, e.num_accepted, e.num_emitted) if isinstance(e, RoundEvent) else
                (e.token_id, e.draft_prob, e.target_prob)
                for e in generate(target, drafter, feature_pair.tokenizer, prompt, cfg) if hasattr(e, "round_index")]

    assert rounds(direct) == rounds(handed)
    assert len(written) > 20 and direct._features.capacity > 256 and direct._drafted.capacity > 256


def test_drafter_without_target_features_says_so(feature_pair):
    drafter = feature_pair.make_drafter("model")
    drafter.start()
    with pytest.raises(ValueError, match="target's features"):
        drafter.propose([1, 2, 3], 2, SamplingParams(), torch.rand(2))


@pytest.mark.parametrize("top_k", [0, 5])
def test_branch_tree_matches_one_branch_at_a_time(feature_pair, top_k):
    """SSD's cache fill: the batched tree pass drafts exactly what per-branch drafting does; under
    a small top-k its rows stay sparse, as the synchronous draft's do."""
    from engine.drafters import Drafter

    tokens = feature_pair.encode_prompt("branches") + [11, 12, 13]
    drafter = feature_pair.make_drafter("model", "fast", "float32")
    drafter.start()
    drafter.observe_target(0, _features(feature_pair, "fast", tokens)[:-1])
    params = SamplingParams(temperature=0.8, top_k=top_k)
    spec = drafter.propose(tokens, 3, params, torch.rand(3)).tokens
    forks = [(0, 7), (1, 9), (2, 11), (3, 13), (3, 14)]
    uniforms = torch.rand(len(forks), 3)
    shape = lambda probs, i: (probs + 0.01) / (probs + 0.01).sum(-1, keepdim=True)  # noqa: E731
    for s in (None, shape):
        tree = drafter.propose_branches(tokens, spec, forks, 3, params, uniforms, s)
        loop = Drafter.propose_branches(drafter, tokens, spec, forks, 3, params, uniforms, s)
        for a, b in zip(tree, loop):
            assert a.tokens == b.tokens
            torch.testing.assert_close(a.probs, b.probs, rtol=1e-4, atol=1e-6)
            assert (a.support is not None) == (top_k > 0 and s is None)
    rows = drafter.score(tokens, spec)
    first = drafter.propose(tokens, 1, SamplingParams(temperature=1.0), torch.rand(1)).probs[0]
    torch.testing.assert_close(torch.softmax(rows[0], -1), first, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("weight_dtype", ["float32", "q4_1_a16"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=20, top_p=0.9), SamplingParams()])
def test_native_tree_step_drafts_the_same_bits_as_the_torch_tree(feature_pair, weight_dtype, params):
    """SSD's cache fill, one native call per depth (`FeatureStep.tree`) against the torch tree path:
    the same branch tokens, supports and probabilities, bit for bit, and the same forward count."""
    if not cpu_kernels.available():
        pytest.skip("the native kernels did not build")
    tokens = feature_pair.encode_prompt("branches") + [11, 12, 13]
    feats = _features(feature_pair, "fast", tokens)[:-1]
    fused, plain = (feature_pair.make_drafter("model", "fast", weight_dtype) for _ in range(2))
    assert fused._step is not None
    plain._step = None
    forks = [(0, 7), (1, 9), (2, 11), (3, 13), (3, 14)]
    uniforms = torch.rand(len(forks), 3)
    drafted = []
    for drafter in (fused, plain):
        drafter.start()
        drafter.observe_target(0, feats)
        spec = drafter.propose(tokens, 3, params, torch.full((3,), 0.5)).tokens
        drafted.append((spec, drafter.propose_branches(tokens, spec, forks, 3, params, uniforms)))
    (spec_a, got), (spec_b, want) = drafted
    assert spec_a == spec_b
    for a, b in zip(got, want):
        assert a.tokens == b.tokens
        assert torch.equal(a.support[0], b.support[0]) and torch.equal(a.support[1], b.support[1])
    assert fused.lm.num_forwards == plain.lm.num_forwards and fused.lm.length == plain.lm.length


def test_features_observed_a_round_at_a_time_past_the_buffer_match_one_observation(feature_pair, backend):
    """The feature buffer grows past its first 256 rows while rounds observe a few features each
    and roll some back: drafting then matches a drafter that observed them all at once."""
    tokens = feature_pair.encode_prompt("a long feature draft test") + [(7 * i) % 97 + 3 for i in range(300)]
    feats = _features(feature_pair, backend, tokens)
    params = SamplingParams(temperature=0.9)
    u = torch.rand(2)
    a = feature_pair.make_drafter("model", backend)
    a.start()
    for start in range(0, len(tokens) - 3, 5):
        a.observe_target(start, feats[start:start + 7])  # the last two are overwritten by the next round
    a.observe_target(len(tokens) - 8, feats[-8:])
    b = feature_pair.make_drafter("model", backend)
    b.start()
    b.observe_target(0, feats)
    pa, pb = a.propose(tokens, 2, params, u), b.propose(tokens, 2, params, u)
    assert pa.tokens == pb.tokens
    torch.testing.assert_close(pa.probs, pb.probs, rtol=1e-4, atol=1e-6)

"""SSD building blocks: fan-out (Theorem 12), Saguaro sampling (Def. 14), cache keys, backups
(Theorem 17), the speedup model (Theorem 7), device specs, the batched tree decode, the fill sized
to the verification, the first-token redraw of a feature draft's hits and the projection."""

import math

import pytest
import torch

from tests.stats import matches
from tests.test_feature_draft import _features, feature_pair  # noqa: F401 (a fixture)
from engine.acceptance import RandomDraws, verify
from engine.drafters import Drafter
from engine.sampling import SamplingParams
from engine.ssd.backups import fast_backup, ngram_backup, resolve_backup
from engine.ssd.devices import parse_device, parse_devices
from engine.ssd.fanout import FanoutPlanner, geometric_fanout, geometric_weights, round_to_budget, uniform_fanout
from engine.ssd.saguaro import saguaro_distribution, saguaro_shape
from engine.ssd.fill_budget import MARGIN, FillSizer
from engine.ssd.projection import ProjectionTrace, RoundTiming
from engine.ssd.speculation_cache import SpeculationCache, couple_first_token, fork_keys
from engine.ssd.theory import best_backup, sd_speedup, ssd_speedup


def test_geometric_fanout_matches_the_worked_example():
    """ALGORITHMS.md §4.3: a = 0.8, r = 1, K = 6, B = 21 gives ≈ [3.6, 3.3, 2.9, 2.6, 2.3, 2.1, 4.2]."""
    w = geometric_weights(0.8, 1.0, 6)
    f = [21 * x / sum(w) for x in w]
    assert f == pytest.approx([3.6, 3.3, 2.9, 2.6, 2.3, 2.1, 4.2], abs=0.06)
    ints = geometric_fanout(21, 0.8, 1.0, 6)
    assert sum(ints) == 21 and all(abs(a - b) < 1 for a, b in zip(ints, f))


def test_geometric_fanout_is_the_lagrangian_optimum():
    """Among integer allocations of B, Theorem 12's rounding is within one step of the best
    expected hit probability Σ P(k)(1 − F_k^{−r}) (checked by exhaustive search for K = 3)."""
    a, r, k, budget = 0.7, 0.8, 3, 10
    p = [(1 - a) * a**j for j in range(k)] + [a**k]

    def value(f):
        return sum(pk * (1 - fk ** -r) for pk, fk in zip(p, f) if fk > 0)

    best = max(((x, y, z, budget - x - y - z) for x in range(budget + 1) for y in range(budget + 1 - x)
                for z in range(budget + 1 - x - y)), key=value)
    ours = geometric_fanout(budget, a, r, k)
    assert value(ours) >= value(best) - 0.01


def test_uniform_fanout_and_rounding():
    assert uniform_fanout(15, 4) == [3, 3, 3, 3, 3]
    assert uniform_fanout(7, 4) == [2, 2, 1, 1, 1]
    assert sum(round_to_budget([0.1, 0.2, 0.7], 11)) == 11
    with pytest.raises(ValueError):
        round_to_budget([0.0, 0.0], 3)


def test_planner_fits_the_power_law_exponent_and_acceptance():
    gen = torch.Generator().manual_seed(0)
    planner = FanoutPlanner()
    true_r = 0.7
    for _ in range(3000):
        f = int(torch.randint(2, 9, (1,), generator=gen))
        planner.observe_lookup(f, bool(torch.rand(1, generator=gen) >= f ** -true_r))
    assert planner.fitted_r() == pytest.approx(true_r, abs=0.08)
    assert planner.power_r(2.5) == 2.5  # a user-set r wins
    planner.observe_round(300, 400)
    assert planner.acceptance == pytest.approx(0.75, abs=0.01)
    plan = planner.plan("geometric", 12, 4)
    assert sum(plan) == 12 and plan[0] >= plan[3]


def test_saguaro_downweights_the_top_f_plus_one_and_keeps_the_rest_proportional():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    out = saguaro_distribution(probs, fanout=1, c=0.5)  # top-2 scaled
    z = 0.4 * 0.5 + 0.3 * 0.5 + 0.3
    assert out.tolist() == pytest.approx([0.2 / z, 0.15 / z, 0.2 / z, 0.06 / z, 0.04 / z])
    assert torch.equal(saguaro_distribution(probs, 2, 1.0), probs)  # C = 1 is off
    one_hot = torch.tensor([0.0, 1.0, 0.0])
    assert torch.equal(saguaro_distribution(one_hot, 1, 0.2), one_hot)  # greedy: no effect
    assert saguaro_shape([3, 3], 1.0) is None
    shape = saguaro_shape([1, 2], 0.5)
    assert torch.allclose(shape(probs, 0), out) and torch.allclose(shape(probs, 5), saguaro_distribution(probs, 2, 0.5))
    with pytest.raises(ValueError, match="downweight_c"):
        saguaro_distribution(probs, 1, 0.0)


def test_saguaro_moves_residual_mass_onto_the_cached_guesses():
    """Def. 14's point: with D' the recovered token lands in the draft's top-F more often."""
    gen = torch.Generator().manual_seed(3)
    gains = []
    for _ in range(50):
        t = torch.softmax(torch.randn(50, generator=gen) * 2, -1)
        d = torch.softmax(torch.log(t) + 0.5 * torch.randn(50, generator=gen), -1)
        top = torch.topk(d, 4).indices

        def residual_mass(draft):
            res = (t - draft).clamp_min(0)
            return float(res[top].sum() / res.sum())

        gains.append(residual_mass(saguaro_distribution(d, 3, 0.3)) - residual_mass(d))
    assert sum(gains) / len(gains) > 0.05


def test_fork_keys_exclude_the_drafted_token_and_follow_the_fanout():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0],
                           [1.0, 2.0, 3.0, 4.0, 5.0],
                           [0.0, 9.0, 8.0, 0.0, 0.0]])
    keys = fork_keys(logits, [0, 4], [2, 1, 2])
    assert keys == [(0, 1), (0, 2), (1, 3), (2, 1), (2, 2)]
    assert fork_keys(logits[:1], [], [0, 0, 3]) == [(0, 0), (0, 1), (0, 2)]  # bonus depth uses F_K
    with pytest.raises(ValueError, match="logit rows"):
        fork_keys(logits, [0], [1, 1])


def test_cache_lookup_cuts_to_the_current_k():
    from engine.drafters import Proposal

    cache = SpeculationCache({(1, 7): Proposal([1, 2, 3], torch.eye(5)[:3])}, (1, 1))
    hit = cache.lookup((1, 7), 2)
    assert hit.tokens == [1, 2] and hit.probs.shape == (2, 5)
    assert cache.lookup((0, 7), 2) is None and cache.keys() == ((1, 7),)


@pytest.mark.parametrize("method", ["sps", "tas", "cactus"])
def test_a_rejected_draft_token_is_never_the_recovered_token(method):
    """Why the cache guesses exclude x_{k+1} for k < K, under every rule SSD supports."""
    gen = torch.Generator().manual_seed(5)
    b, k, v = 4000, 1, 6
    t = torch.softmax(torch.randn(b, k + 1, v, generator=gen) * 1.5, -1)
    d = torch.softmax(torch.randn(b, k, v, generator=gen) * 1.5, -1)
    x = torch.multinomial(d[:, 0], 1, generator=gen)
    res = verify(method, t, d, x, draws=RandomDraws.draw(b, k, gen), delta=0.5, posterior_threshold=0.3)
    rejected = res.num_accepted == 0
    assert int(rejected.sum()) > 100
    assert not bool((res.next_tokens[rejected] == x[rejected, 0]).any())


def test_speedup_model_theorem7_and_corollary():
    assert ssd_speedup(1.0, 4.0, 2.0, 0.5, 1.0) == pytest.approx(4.0)  # all hits, T_p < 1: E_hit per verify
    assert ssd_speedup(0.0, 4.0, 2.0, 0.5, 1.0) == pytest.approx(1.0)  # all misses: E_miss / (1 + T_b)
    # Same draft as primary and backup (E_miss = E_SD, T_b = T_SD <= T_p... here T_p = T_SD): never slower.
    for p in (0.0, 0.3, 0.9):
        assert ssd_speedup(p, 3.0, 3.0, 0.6, 0.6) >= sd_speedup(3.0, 0.6) - 1e-12


def test_theorem17_backup_switches_from_neural_to_fast_with_batch_size():
    args = dict(p_hit=0.6, e_hit=3.5, e_sd=3.0, e_fast=1.0, t_p=0.8, t_b=0.5)
    choices = [best_backup(b, **args) for b in (1, 2, 4, 8, 16, 64)]
    assert choices[0] == "neural" and choices[-1] == "fast"
    assert choices == sorted(choices, key=lambda c: c == "fast")  # one switch point b*
    assert resolve_backup("adaptive", 8, {}) == "neural"  # nothing measured yet
    rates = dict(p_hit=0.8, e_hit=3.5, e_miss_neural=3.0, e_miss_fast=1.0, t_p=0.8, t_b=0.8)
    assert resolve_backup("adaptive", 64, rates) == "fast"
    assert resolve_backup("ngram", 64, rates) == "ngram"


def test_fast_and_ngram_backups():
    tokens = fast_backup(5, 10, torch.Generator().manual_seed(0))
    assert len(tokens) == 5 and all(0 <= t < 10 for t in tokens)
    assert ngram_backup([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert ngram_backup([1, 2, 3], 3) == []


def test_device_specs_parse_and_refuse_clearly():
    d = parse_device("cpu:0")
    assert d.cores == (0,) and str(d) == "cpu:0"
    assert parse_device("cpu:0-1").cores == (0, 1)
    for bad, msg in (("gpu:0", "not of the form"), ("cpu:1-0", "empty"), ("cpu:999", "do not exist"),
                     (f"cuda:{torch.cuda.device_count()}", "CUDA device")):
        with pytest.raises(ValueError, match=msg):
            parse_device(bad)
    target, draft = parse_devices("target=cpu:0,draft=cpu:1")
    assert (target.cores, draft.cores) == ((0,), (1,))
    with pytest.raises(ValueError, match="share cores"):
        parse_devices("target=cpu:0-1,draft=cpu:1")
    with pytest.raises(ValueError, match="target=<device>"):
        parse_devices("cpu:0,cpu:1")


@pytest.mark.parametrize("temperature,saguaro", [(0.0, False), (1.0, False), (1.0, True)])
def test_tree_pass_equals_one_branch_at_a_time(tiny_pair, temperature, saguaro):
    """ModelDrafter's batched tree decode drafts exactly what the per-branch default drafts."""
    tree = tiny_pair.make_drafter("model", "fast", "float32")
    loop = tiny_pair.make_drafter("model", "fast", "float32")
    context, speculation = list(range(5, 25)), [40, 41, 42]
    forks = [(0, 7), (0, 8), (1, 9), (2, 10), (3, 11), (3, 12)]
    params = SamplingParams(temperature)
    uniforms = torch.rand(len(forks), 4)
    shape = saguaro_shape([2, 2, 2, 2], 0.4) if saguaro else None
    tree.score(context, speculation)  # the glue decode the worker runs first
    got = tree.propose_branches(context, speculation, forks, 4, params, uniforms, shape)
    want = Drafter.propose_branches(loop, context, speculation, forks, 4, params, uniforms, shape)
    for a, b in zip(got, want):
        assert a.tokens == b.tokens
        assert torch.allclose(a.probs, b.probs, atol=1e-5)
    assert tree.lm.length == len(context) + len(speculation)  # the tree stays in scratch slots
    scored = tree.score(context, speculation).log_softmax(-1)
    assert torch.allclose(scored, Drafter.score(loop, context, speculation), atol=1e-4)


def test_default_branches_work_for_a_drafter_without_a_model(tiny_pair):
    drafter = tiny_pair.make_drafter("ngram")
    out = drafter.propose_branches([1, 2, 3, 1, 2], [3], [(0, 9), (1, 1)], 2, SamplingParams(), torch.rand(2, 2))
    assert out[1].tokens == [2, 3] and out[0].tokens == []
    with pytest.raises(ValueError, match="k >= 1"):
        drafter.propose_branches([1], [], [(0, 1)], 0, SamplingParams(), torch.rand(1, 0))


def _sizer(window: float, glue: float, steps: dict[int, float]) -> FillSizer:
    sizer = FillSizer()
    sizer.observe_window(window)
    for _ in range(2):  # the first observation of each kind is a warm-up and is skipped
        sizer.observe_glue(glue)
        for n, t in steps.items():
            sizer.observe_step(n, t)
    return sizer


def test_fill_keeps_the_depth_and_takes_the_largest_budget_that_fits_the_window():
    # step(n) = 1 ms + 0.1 ms per branch, glue 2 ms, window 20 ms (18 ms planned), K = 3:
    # 2 + 3 (1 + 0.1 B) <= 18  ->  B <= 43
    sizer = _sizer(0.020, 0.002, {1: 0.0011, 11: 0.0021, 21: 0.0031})
    assert sizer.step_seconds(10) == pytest.approx(0.002)
    plan = sizer.plan([20, 20, 20, 20])
    assert (plan.budget, plan.depth) == (43, 3)  # the uniform plan scaled down
    assert plan.fanouts == (11, 11, 11, 10)
    assert sizer.plan([3, 3, 3, 3]).fanouts == (3, 3, 3, 3)  # the request fits: unchanged
    # Geometric plans stay geometric when scaled (largest-remainder rounding of the same weights).
    assert sizer.plan([20, 10, 5, 40]).fanouts == tuple(round_to_budget([20, 10, 5, 40], 43))


def test_fill_shortens_the_depth_then_skips_when_nothing_fits():
    sizer = _sizer(0.010, 0.002, {1: 0.003, 2: 0.003})  # one step 3 ms: 2 + 3d <= 9 -> d = 2
    plan = sizer.plan([2, 2, 2, 2, 2])
    assert plan.depth == 2 and plan.budget == 10
    assert sizer.plan([2, 2], sequences=4).depth == 0  # a quarter of the window fits no step
    assert FillSizer().plan([2, 2]).depth == 1  # nothing measured yet: the first fill measures
    assert MARGIN < 1


def test_the_window_is_planned_for_the_length_the_reply_served():
    """The target verifies the served tokens plus one, and on one core each row lengthens the
    verification by ~40 %: after a one-token hit the window is short, after a K-token miss long.
    One smoothed window would plan both alike: too much after the short reply (the request cuts the
    fill), too little after the long one."""
    sizer = _sizer(0.010, 0.002, {1: 0.001, 11: 0.002})  # step(n) = 0.9 ms + 0.1 ms per branch
    for _ in range(5):
        sizer.observe_window(0.008, served=1)
        sizer.observe_window(0.016, served=3)
    assert sizer.window_for(1) == pytest.approx(0.008, rel=0.01)
    assert sizer.window_for(3) == pytest.approx(0.016, rel=0.01)
    assert sizer.window_for(2) == pytest.approx(0.012, rel=0.01)  # between the measured lengths
    assert sizer.window_for(None) == sizer.window  # no length given: every reply's window
    short, long = sizer.plan([20, 20, 20, 20], served=1), sizer.plan([20, 20, 20, 20], served=3)
    # 2 + 3 (0.9 + 0.1 B) <= 0.9 * 8 -> B = 8; <= 0.9 * 16 -> B = 32
    assert (short.depth, short.budget) == (3, 8) and (long.depth, long.budget) == (3, 32)
    fresh = _sizer(0.010, 0.002, {1: 0.001, 11: 0.002})
    fresh.observe_window(0.008, served=1)
    assert fresh.window_for(3) == fresh.window  # one length measured: no line to extend yet


def test_a_feature_draft_cache_is_never_shallower_than_two_tokens():
    """A feature draft's hit redraws its first token (engine.ssd.worker): a one-token cache saves no
    draft step, so the plan never stops at depth 1 for it, and at K = 1 it makes none, saying why."""
    sizer = _sizer(0.008, 0.002, {1: 0.003, 2: 0.003})  # 2 + 3d <= 7.2 -> d = 1 only
    assert sizer.plan([2, 2, 2]).depth == 1
    plan = sizer.plan([2, 2, 2], min_depth=2)
    assert (plan.depth, plan.budget) == (0, 0) and "cache of 2 tokens per branch does not fit" in plan.note
    at_k1 = FillSizer().plan([3, 3], min_depth=2)
    assert at_k1.depth == 0 and at_k1.note.startswith("no fill at K = 1")
    assert _sizer(0.020, 0.002, {1: 0.003, 2: 0.003}).plan([2, 2, 2], min_depth=2).depth == 2


def test_coupled_first_token_is_a_draw_from_the_fresh_distribution_and_keeps_the_cached_one_when_it_can():
    """The redraw that makes a feature draft's cache hit as good as a synchronous draft: whatever
    the stale D~ the cached token came from, the served token follows the fresh D exactly, and it
    is the cached one with probability 1 - TV(D, D~)."""
    gen = torch.Generator().manual_seed(3)
    fresh = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    cached = torch.tensor([0.1, 0.2, 0.3, 0.1, 0.3])
    n = 20000
    drawn = torch.multinomial(cached, n, replacement=True, generator=gen)
    out, kept = [], 0
    for x, u in zip(drawn.tolist(), torch.rand(n, 2, generator=gen)):
        token, k = couple_first_token(fresh, cached, x, u)
        out.append(token)
        kept += k and token == x
    assert matches(torch.tensor(out), fresh)
    tv = 0.5 * float((fresh - cached).abs().sum())
    assert abs(kept / n - (1 - tv)) < 0.02
    assert couple_first_token(fresh, fresh, 2, torch.tensor([0.99, 0.5])) == (2, True)


def test_the_coupling_draws_the_same_token_from_sparse_rows_as_from_dense_ones():
    """A hit's redraw reads the draft's rows in their sparse form (top-k ids and probabilities, as the
    synchronous draft gives them): the same uniforms give the same token and decision as the dense
    rows, so the sparse path changes the serve's cost only."""
    gen = torch.Generator().manual_seed(5)
    vocab = 60
    for _ in range(300):
        rows = []
        for _ in range(2):
            ids = torch.randperm(vocab, generator=gen)[:8]
            probs = torch.rand(8, generator=gen) * (torch.rand(8, generator=gen) > 0.2)
            probs = probs / probs.sum().clamp(min=1e-9)
            rows.append((ids, probs, torch.zeros(vocab).index_copy_(0, ids, probs)))
        (f_ids, f_probs, fresh), (c_ids, c_probs, cached) = rows
        token = int(c_ids[int(torch.randint(8, (1,), generator=gen))])
        u = torch.rand(2, generator=gen)
        assert couple_first_token((f_ids, f_probs), (c_ids, c_probs), token, u) == couple_first_token(fresh, cached, token, u)


def test_a_just_in_time_feature_branch_drafts_what_a_synchronous_draft_does(feature_pair):
    """The neural backup (the one-branch tree forking at the last committed token) uses the target's
    real features, as `propose` does, not the draft's own predicted ones."""
    tokens = feature_pair.encode_prompt("backup") + [11, 12, 13]
    sync = feature_pair.make_drafter("model", "fast", "float32")
    jit = feature_pair.make_drafter("model", "fast", "float32")
    features = _features(feature_pair, "fast", tokens)[:-1]  # the target has verified every token but the last
    for d in (sync, jit):
        d.start()
        d.observe_target(0, features)
    params = SamplingParams(temperature=0.8)
    u = torch.rand(3)
    want = sync.propose(tokens, 3, params, u)
    got = jit.propose_branches(tokens[:-1], [], [(0, tokens[-1])], 3, params, u[None])[0]
    assert got.tokens == want.tokens
    torch.testing.assert_close(got.probs, want.probs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("features", [False, True])
def test_a_cut_fill_serves_a_prefix_of_the_full_fill(tiny_pair, feature_pair, features):
    """A fill stopped early (the next request is due) holds the first tokens of the branches the
    full fill would have drafted, with the same distributions: cutting never changes what is
    served, only how much, so the output stays exact."""
    pair = feature_pair if features else tiny_pair
    context = pair.encode_prompt("cut the fill") + [30, 31, 32]
    speculation, forks = [40, 41], [(0, 7), (1, 9), (2, 11), (2, 12)]
    params, uniforms = SamplingParams(0.9), torch.rand(4, 3)
    drafted = []
    for cut in (None, 2):
        d = pair.make_drafter("model", "fast", "float32")
        d.start()
        if features:
            d.observe_target(0, _features(pair, "fast", context)[:-1])
        d.score(context, speculation)
        calls = iter(range(10))
        stop = None if cut is None else (lambda: next(calls) >= cut)
        drafted.append(d.propose_branches(context, speculation, forks, 3, params, uniforms, None, stop))
    full, short = drafted
    assert len(short) == len(full) and all(len(b.tokens) == 2 for b in short)
    for a, b in zip(short, full):
        assert a.tokens == b.tokens[:2]
        torch.testing.assert_close(a.probs, b.probs[:2])


def test_projection_replaces_only_the_verification_and_charges_a_fill_that_no_longer_fits():
    def trace_of(fill: float) -> ProjectionTrace:
        trace = ProjectionTrace(prefill=0.1, prefill_full=0.05)
        for _ in range(10):
            trace.add(RoundTiming(emitted=2, verify=0.020, verify_full=0.010, loop=0.004, serve=0.002, message=0.001,
                                  fill=fill))
        return trace

    trace = trace_of(0.012)
    # pinned: 0.1 + 10 (0.003 + max(0.024, 0.012)); full machine: 0.05 + 10 (0.003 + max(0.014, 0.012))
    assert trace.tokens_per_s(False) == pytest.approx(20 / (0.1 + 10 * 0.027))
    assert trace.tokens_per_s(True) == pytest.approx(20 / (0.05 + 10 * 0.017))
    assert trace_of(0.030).tokens_per_s(True) == pytest.approx(20 / (0.05 + 10 * 0.033))  # the fill outlasts the faster verify
    assert "projected" in trace.summary()["projection_assumptions"]


def test_rounds_drafted_in_the_target_process_are_no_misses():
    """E_miss (Theorem 7) is over lookups the cache did not answer; a round drafted in the target
    process (by choice at K = 1 with a feature draft, or once the worker is gone) looked nothing up."""
    from engine.metrics import SSDMetrics

    m = SSDMetrics()
    for source, looked_up, emitted in (("local", False, 2), ("sync", False, 2), ("cache", True, 3), ("neural", True, 1)):
        m.add_row(source, looked_up, emitted)
    rates = m.rates()
    assert rates["p_hit"] == 0.5 and rates["e_hit"] == 3 and rates["e_miss"] == 1
    only_local = SSDMetrics()
    only_local.add_row("local", False, 2)
    assert only_local.rates()["e_miss"] is None and only_local.rates()["p_hit"] is None

import importlib.util
import json
import re
import sys
import types

import pytest

from engine import bench
from engine.peers import llama_cpp as llama_cpp_peer


def test_bench_writes_rows_for_every_method_and_peer(tmp_path, capsys):
    out = tmp_path / "rows.json"
    bench.main(["--pair", "tiny", "--methods", "ar,sps,tas,cactus", "--peers", "hf-ar,hf-assisted", "--prompts", "1",
                "--repeats", "1", "--max-new-tokens", "12", "--k", "3", "--json", str(out)])
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"ar", "sps", "tas", "cactus", "hf-ar", "hf-assisted"}
    for row in rows.values():
        for key in ("tokens_per_s", "new_tokens", "mean_acceptance_length", "draft_acceptance_rate",
                    "target_forwards_per_token", "mean_induced_kl", "devices"):
            assert key in row, key
        assert row["tokens_per_s"] > 0 and row["new_tokens"] > 0
    # the prefill yields the first token, so n tokens take n - 1 decoding forwards (as in HF generate)
    n = rows["ar"]["new_tokens"]
    assert rows["ar"]["target_forwards_per_token"] == (n - 1) / n
    assert rows["sps"]["mean_induced_kl"] == 0.0  # lossless: exactly the target at every tested position
    assert rows["ar"]["mean_induced_kl"] is None and rows["cactus"]["mean_induced_kl"] >= 0.0
    assert 0.0 <= rows["sps"]["draft_acceptance_rate"] <= 1.0
    assert "tokens_per_s" in capsys.readouterr().out


@pytest.mark.slow
def test_hf_assisted_refuses_a_draft_it_cannot_run(default_pair):
    with pytest.raises(SystemExit, match="needs a standalone draft model"):
        bench.main(["--pair", "default", "--methods", "ar", "--peers", "hf-assisted", "--prompts", "1",
                    "--repeats", "1", "--max-new-tokens", "4"])


def test_bench_sweeps_k_side_by_side_running_ar_once(tmp_path, capsys):
    out = tmp_path / "rows.json"
    bench.main(["--pair", "tiny", "--methods", "ar,sps", "--peers", "", "--prompts", "1", "--repeats", "1",
                "--max-new-tokens", "10", "--k", "1,3", "--drafter", "self", "--temperature", "0", "--json", str(out)])
    rows = {r["label"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"ar", "sps K=1", "sps K=3"}
    assert rows["ar"]["k"] is None and rows["sps K=1"]["k"] == 1 and rows["sps K=3"]["k"] == 3
    # The target drafting for itself at T = 0 is always accepted, so each row's K shows in its
    # acceptance length: exactly 1 + 1 at K = 1, well above that at K = 3.
    assert rows["sps K=1"]["mean_acceptance_length"] == 2.0
    assert rows["sps K=3"]["mean_acceptance_length"] > 3.0
    assert "sps K=3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--pair", "tiny", "--k", "1,x"])
    assert "--k wants integers" in capsys.readouterr().err


def test_bench_compares_weight_formats_side_by_side(tmp_path, capsys):
    out = tmp_path / "rows.json"
    bench.main(["--pair", "tiny", "--methods", "ar,sps", "--peers", "hf-ar", "--prompts", "1", "--repeats", "1",
                "--max-new-tokens", "8", "--k", "2", "--temperature", "0", "--weight-dtype", "float32,int8",
                "--json", str(out)])
    rows = {r["label"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"ar [float32]", "ar [int8]", "sps [float32]", "sps [int8]", "hf-ar"}
    for fmt in ("float32", "int8"):
        assert rows[f"ar [{fmt}]"]["weight_dtype"] == fmt
        assert rows[f"ar [{fmt}]"]["speedup_vs_ar"] == 1.0  # each format against its own AR
        assert rows[f"sps [{fmt}]"]["backend"] == f"fast/{fmt}"
    assert rows["hf-ar"]["weight_dtype"] is None and rows["hf-ar"]["backend"] == "transformers generate()"
    assert "ar [int8]" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--pair", "tiny", "--weight-dtype", "float16,fp8"])
    assert "--weight-dtype wants" in capsys.readouterr().err


def test_profile_shows_each_phase_and_what_a_cold_python_step_costs(capsys):
    bench.main(["--pair", "tiny", "--methods", "ar,sps", "--peers", "", "--prompts", "1", "--repeats", "1",
                "--max-new-tokens", "8", "--k", "2", "--profile"])
    out = capsys.readouterr().out
    profile = out[out.index("per-round profile"):]
    assert all(phase in profile for phase in ("draft_forward", "sampling_rule", "rollback", "between_rounds"))
    cold = re.search(r"right after a target forward: ([\d.]+) us; right after another: ([\d.]+) us", profile)
    assert cold and float(cold.group(1)) > 0 and float(cold.group(2)) > 0
    assert "forwards_only_vs_ar" in profile


def test_forwards_only_speedup_is_the_ceiling_with_every_overhead_phase_free(tmp_path):
    bench.main(["--pair", "tiny", "--methods", "ar,sps", "--peers", "", "--prompts", "1", "--repeats", "1",
                "--max-new-tokens", "8", "--k", "2", "--profile", "--json", str(tmp_path / "rows.json")])
    rows = {r["method"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert rows["ar"]["forwards_only_speedup"] == 1.0
    sps, ar_forward = rows["sps"], rows["ar"]["profile_ms_per_round"]["verify_forward"]
    forwards = sps["profile_ms_per_round"]["draft_forward"] + sps["profile_ms_per_round"]["verify_forward"]
    assert sps["forwards_only_speedup"] == pytest.approx(sps["mean_acceptance_length"] * ar_forward / forwards)
    # By hand: 1.5 tokens a round for 1 + 4 ms of forwards, against AR's 3 ms a token.
    row = {"method": "sps", "mean_acceptance_length": 1.5,
           "profile_ms_per_round": {"draft_forward": 1.0, "verify_forward": 4.0}}
    assert bench.forwards_only_speedup(row, {"profile_ms_per_round": {"verify_forward": 3.0}}) == pytest.approx(0.9)


def test_bench_rejects_unknown_methods():
    with pytest.raises(SystemExit, match="unknown method"):
        bench.main(["--pair", "tiny", "--methods", "ar,medusa"])


@pytest.mark.slow
def test_llama_cpp_peer_row_runs_the_embedded_gguf_or_says_what_it_needs(tmp_path):
    args = ["--pair", "default", "--methods", "ar", "--peers", "llama.cpp", "--prompts", "1", "--repeats", "1",
            "--max-new-tokens", "8", "--ignore-eos", "--json", str(tmp_path / "rows.json")]
    if importlib.util.find_spec("llama_cpp") is None:
        with pytest.raises(SystemExit, match="llama-cpp-python"):
            bench.main(args)
        return
    bench.main(args)
    rows = {r["method"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert rows["llama.cpp"]["new_tokens"] == 8 and rows["llama.cpp"]["tokens_per_s"] > 0
    assert rows["llama.cpp"]["backend"] == ("llama.cpp (GGUF Q4_1, one token per micro-batch)"
                                            if llama_cpp_peer.one_token_batches() else "llama.cpp (GGUF Q4_1)")


def test_llama_cpp_takes_one_token_per_micro_batch_exactly_where_the_cpu_has_amx(monkeypatch):
    """llama.cpp's AMX GEMM dies with SIGILL on the Xeons here; its one-token path does not (engine.peers.llama_cpp)."""
    made = []
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=lambda **kwargs: made.append(kwargs)))
    for flags, ubatch in ((frozenset({"avx512f", "amx_tile", "amx_int8"}), 1), (frozenset({"avx2", "fma"}), None)):
        monkeypatch.setattr(llama_cpp_peer, "cpu_flags", lambda: flags)
        llama_cpp_peer.load_llama(2)
        assert made[-1].get("n_ubatch") == ubatch
        assert made[-1]["n_threads"] == made[-1]["n_threads_batch"] == 2


def test_bench_runs_ssd_next_to_sps_with_devices_and_hit_rate(tmp_path):
    import json

    from engine.bench import main

    out = tmp_path / "rows.json"
    main(["--pair", "tiny", "--methods", "sps,ssd", "--peers", "", "--devices", "target=cpu:0,draft=cpu:1",
          "--prompts", "2", "--repeats", "1", "--max-new-tokens", "12", "--temperature", "0", "--batch-size", "2",
          "--fanout-mode", "geometric", "--budget", "12", "--backup", "adaptive", "--json", str(out)])
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert rows["ssd"]["new_tokens"] == rows["sps"]["new_tokens"] == 24
    assert rows["ssd"]["cache_hit_rate"] is not None and rows["ssd"]["budget"] == 12
    assert "draft=cpu:1" in rows["ssd"]["devices"] and rows["sps"].get("cache_hit_rate") is None
    ssd, sps = rows["ssd"], rows["sps"]
    assert ssd["vs_sps_runs"] == [ssd["tokens_per_s"] / sps["tokens_per_s"]] == [ssd["vs_sps"]]
    assert ssd["hit_ceiling_vs_sps"] == 1 + sps["draft_ms_per_token"] * ssd["k"] / sps["verify_ms_per_round"]


def test_an_ssd_rows_budget_is_the_one_its_k_ran_with(tmp_path):
    import json

    out = tmp_path / "rows.json"
    bench.main(["--pair", "tiny", "--methods", "ssd", "--peers", "", "--devices", "target=cpu:0,draft=cpu:1",
                "--prompts", "1", "--repeats", "1", "--max-new-tokens", "6", "--k", "1,2", "--fanout", "3",
                "--json", str(out)])
    assert {r["k"]: r["budget"] for r in json.loads(out.read_text())} == {1: 6, 2: 9}  # B = F·(K+1)


def test_ssd_hit_ceiling_is_one_plus_the_sps_draft_over_its_verify():
    """Corollary 9's upper bound by hand: SpS drafting 2 x 0.25 ms against a 5 ms verification
    leaves SSD at most 1.1x, whatever its hit rate; per-repeat ratios pair the same repeats."""
    sps = [{"tokens_per_s": 100.0, "draft_ms_per_token": 0.25, "verify_ms_per_round": 5.0},
           {"tokens_per_s": 200.0, "draft_ms_per_token": 0.25, "verify_ms_per_round": 5.0}]
    ssd = [{"tokens_per_s": 90.0}, {"tokens_per_s": 210.0}]
    got = bench.ssd_against_sps({"k": 2}, ssd, sps)
    assert got["hit_ceiling_vs_sps"] == pytest.approx(1.1)
    assert got["vs_sps_runs"] == pytest.approx([0.9, 1.05]) and got["vs_sps"] == pytest.approx(0.975)


def test_bench_refuses_bad_ssd_devices():
    import pytest

    from engine.bench import main

    with pytest.raises(SystemExit, match="share cores"):
        main(["--pair", "tiny", "--methods", "ssd", "--peers", "", "--devices", "target=cpu:0-1,draft=cpu:1"])


def test_interleaving_rows_prompt_by_prompt_gives_each_row_its_own_tokens(tiny_pair, tmp_path, monkeypatch):
    """Every row decodes prompt i before any row moves on, the first row rotating, and each row's
    counters (warm-up included) are exactly those of that row run alone over the same prompts and seeds."""
    from dataclasses import replace

    from engine.cli import spec_config_from_args
    from engine.models.registry import GENERIC_K
    from engine.prompts import held_out_prompts

    fed = []
    for kind in (bench.EngineRow, bench.PeerRow):
        def logged(self, prompts, start, add=kind.add):
            fed.append((id(self), start))
            add(self, prompts, start)
        monkeypatch.setattr(kind, "add", logged)
    argv = ["--pair", "tiny", "--methods", "ar,sps,cactus", "--peers", "hf-ar", "--prompts", "3", "--repeats", "1",
            "--max-new-tokens", "10", "--k", "2", "--json", str(tmp_path / "rows.json")]
    bench.main(argv)
    rows = {r["method"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    warm, timed = fed[:4], fed[4:]  # each of the 4 rows warms up once on prompt 0, untimed
    assert [start for _, start in warm] == [0] * 4 and len({row for row, _ in warm}) == 4
    assert [start for _, start in timed] == [0] * 4 + [1] * 4 + [2] * 4
    assert len({timed[4 * i][0] for i in range(3)}) == 3  # a different row goes first on each prompt

    cfg = replace(spec_config_from_args(bench.parse_args(argv), k=GENERIC_K), num_speculative_tokens=2)
    prompts = [tiny_pair.encode_prompt(p) for p in held_out_prompts(3)]
    for method in ("ar", "sps", "cactus", "hf-ar"):
        kind = bench.PeerRow if method == "hf-ar" else bench.EngineRow
        alone = kind(tiny_pair, method, cfg, "model", False).run(prompts)
        for key in ("new_tokens", "mean_acceptance_length", "draft_acceptance_rate", "target_forwards_per_token"):
            assert rows[method][key] == alone[key], (method, key)
        assert rows[method]["mean_induced_kl"] == pytest.approx(alone["mean_induced_kl"])
    assert bench.run_engine(tiny_pair, "sps", prompts, cfg, "model", False)["new_tokens"] == rows["sps"]["new_tokens"]


def test_each_repeat_decodes_its_own_seeds_and_the_statistics_are_their_mean(tiny_pair, tmp_path, monkeypatch):
    """Repeat r decodes prompt i at seed + 1000 r + i for every row alike, so a row's acceptance is the
    mean over several texts, not the first seed's draw, and each repeat's value is kept."""
    from dataclasses import replace

    from engine.cli import spec_config_from_args
    from engine.prompts import held_out_prompts

    fed = []

    def logged(self, prompts, start, add=bench.EngineRow.add):
        fed.append(start)
        add(self, prompts, start)

    monkeypatch.setattr(bench.EngineRow, "add", logged)
    argv = ["--pair", "tiny", "--methods", "sps", "--peers", "", "--prompts", "2", "--repeats", "2",
            "--max-new-tokens", "12", "--k", "2", "--json", str(tmp_path / "rows.json")]
    bench.main(argv)
    assert fed == [0, 0, 1, 1000, 1001]  # the untimed warm-up, then each repeat's seeds
    row = json.loads((tmp_path / "rows.json").read_text())[0]
    cfg = replace(spec_config_from_args(bench.parse_args(argv), k=2), num_speculative_tokens=2)
    prompts = [tiny_pair.encode_prompt(p) for p in held_out_prompts(2)]
    runs = []
    for rep in range(2):
        alone = bench.EngineRow(tiny_pair, "sps", cfg, "model", False)
        alone.begin()
        alone.add(prompts, bench.SEED_STRIDE * rep)
        runs.append(alone.result()["mean_acceptance_length"])
    assert row["mean_acceptance_length_runs"] == runs
    assert row["mean_acceptance_length"] == pytest.approx(sum(runs) / 2)


def test_speedup_vs_ar_is_the_median_of_per_repeat_ratios(tmp_path, capsys):
    out = tmp_path / "rows.json"
    bench.main(["--pair", "tiny", "--methods", "ar,sps", "--peers", "hf-ar", "--prompts", "1", "--repeats", "3",
                "--max-new-tokens", "4", "--k", "1", "--json", str(out)])
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert rows["ar"]["speedup_vs_ar_runs"] == [1.0, 1.0, 1.0] and rows["ar"]["speedup_vs_ar"] == 1.0
    for method in ("sps", "hf-ar"):
        runs = rows[method]["speedup_vs_ar_runs"]
        ar_runs = rows["ar"]["tokens_per_s_runs"]
        assert runs == [a / b for a, b in zip(rows[method]["tokens_per_s_runs"], ar_runs)]
        assert rows[method]["speedup_vs_ar"] == pytest.approx(sorted(runs)[1])
    assert "1.00/1.00/1.00" in capsys.readouterr().out


def test_an_ssd_worker_that_cannot_start_is_a_one_line_error(monkeypatch):
    from engine.ssd.ssd_decoding import SSDEngine, WorkerLost

    def lost(self):
        raise WorkerLost("the draft worker exited (simulated)")

    monkeypatch.setattr(SSDEngine, "start", lost)
    with pytest.raises(SystemExit, match="the SSD row cannot run: the draft worker exited"):
        bench.main(["--pair", "tiny", "--methods", "ssd", "--peers", "", "--prompts", "1", "--repeats", "1",
                    "--max-new-tokens", "4", "--devices", "target=cpu:0,draft=cpu:1"])

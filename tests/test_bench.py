import importlib.util
import json

import pytest

from engine import bench


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
    assert rows["llama.cpp"]["backend"] == "llama.cpp (GGUF Q4_1)"


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


def test_bench_refuses_bad_ssd_devices():
    import pytest

    from engine.bench import main

    with pytest.raises(SystemExit, match="share cores"):
        main(["--pair", "tiny", "--methods", "ssd", "--peers", "", "--devices", "target=cpu:0-1,draft=cpu:1"])

"""API-level tests with gradio_client against the running app, and the 8-session load test."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from gradio_client import Client

from engine.config import SpecConfig
from engine.decoding import generate
from engine.events import FinishEvent
from engine.models import ModelPair, load_pair

# prompt, method, K, δ, temperature, top-p, top-k, ε, α, max new tokens, seed
ARGS = ("The sea is", "cactus", 4, 1.0, 0.8, 0.95, 40, 0.09, 0.3, 24, 5)


def _client(url: str) -> Client:
    return Client(url, verbose=False)


def _direct(prompt: str, method: str, seed: int, max_new: int, pair: ModelPair | None = None,
            temperature: float = 0.8) -> list[int]:
    """The same request straight through the engine, in this process: the reference output."""
    pair = pair or load_pair("tiny")
    cfg = SpecConfig(method=method, num_speculative_tokens=4, delta=1.0, temperature=temperature, top_p=0.95,
                     top_k=40, max_new_tokens=max_new, seed=seed)
    drafter = None if method == "ar" else pair.make_drafter("model")
    finish = [e for e in generate(pair.make_target(), drafter, pair.tokenizer, pair.encode_prompt(prompt), cfg,
                                  eos_token_ids=pair.eos_token_ids) if isinstance(e, FinishEvent)][0]
    return list(finish.token_ids)


def test_generate_endpoint_returns_coloured_tokens_and_metrics(playground_url):
    tokens, status, details, _, _ = _client(playground_url).predict(*ARGS, api_name="/generate")
    assert details["finish_reason"] in ("max_new_tokens", "eos")
    assert len(tokens) == len(details["token_ids"]) > 0
    assert {t["class_or_confidence"] for t in tokens} <= {"accepted", "recovered", "bonus"}
    assert details["metrics"]["mean_acceptance_length"] >= 1
    m = details["metrics"]
    assert m["tested_positions"] > 0 and m["mean_induced_kl"] >= 0 and "KL(induced ‖ T)" in status
    assert "finished" in status
    assert details["token_ids"] == _direct("The sea is", "cactus", 5, 24)


@pytest.mark.parametrize("bad, message", [
    ({0: "   "}, "prompt is empty"),
    ({2: 99}, "greater than maximum value 16|K must be between"),  # Gradio's own range check, or ours
    ({9: 100000}, "greater than maximum|max new tokens must be between"),
    ({1: "ssd-x"}, "not in the list of choices|unknown method"),
    ({4: -1}, "less than minimum|temperature"),
])
def test_bad_input_gets_a_clear_message(playground_url, bad, message):
    args = list(ARGS)
    for i, v in bad.items():
        args[i] = v
    with pytest.raises(Exception, match=message):
        _client(playground_url).predict(*args, api_name="/generate")


def _wait_for_output(job, guard_seconds: float = 120.0) -> None:
    """Until the streaming job has yielded once (its run is installed in the session); a hang guard only."""
    guard = time.monotonic() + guard_seconds
    while not job.outputs() and not job.done():
        assert time.monotonic() < guard, "the generate job never streamed"
        time.sleep(0.02)


def test_pause_change_delta_step_and_stop(playground_url):
    """Pause is armed before Generate, so the run parks after round 0 on any machine; δ changes while
    parked, one Step runs round 1 under it, Stop ends the run there: no timing anywhere."""
    client = _client(playground_url)
    args = list(ARGS)
    args[9] = 256
    assert "armed" in client.predict(api_name="/pause")
    job = client.submit(*args, api_name="/generate")
    _wait_for_output(job)
    assert "paused after round 0" in client.predict(api_name="/pause")
    client.predict(0.3, api_name="/set_delta")
    assert "paused after round 1" in client.predict(api_name="/step")
    client.predict(api_name="/stop")
    _, status, details, _, _ = job.result(timeout=120)
    assert details["finish_reason"] == "stopped", status
    assert details["metrics"]["num_rounds"] == 2 and 2 <= len(details["token_ids"]) <= 2 * (ARGS[2] + 1)
    changes = [c for c in details["config_changes"] if "delta" in c["changes"]]
    assert [c["round"] for c in changes] == [1] and changes[0]["changes"]["delta"] == [1.0, 0.3]
    assert '"active_runs": 0' in client.predict(api_name="/health")  # the engine finished before the reply


def test_compare_endpoint_shares_draws_and_exports(playground_url):
    out = _client(playground_url).predict("Once upon", ["sps", "cactus"], 4, 0.0, 0.8, 0.95, 40, 0.09, 0.3, 16, 2,
                                          api_name="/compare")
    status, table, csv_path, json_path = out[-4:]
    assert "done" in status
    rows = {r[0]: r for r in table["data"]}
    first_difference = table["headers"].index("first_difference")
    assert rows["cactus"][first_difference] is None  # δ = 0: Cactus is SpS, draw for draw
    assert open(csv_path).read().startswith("method,index,token_id")
    assert '"methods"' in open(json_path).read()


SESSIONS = [(f"prompt number {i}: tell me about {w}", m, 100 + i)
            for i, (w, m) in enumerate(zip(["cats", "dogs", "rain", "tea", "maps", "jazz", "salt", "ice"],
                                           ["sps", "tas", "cactus", "ar"] * 2))]


def _eight_sessions(url: str, clients: list[Client], max_new: int) -> list[dict]:
    """Each session's own request, all eight at once; the API's details per session, in order."""
    def one(session):
        client, (prompt, method, seed) = session
        _, _, details, _, _ = client.predict(prompt, method, 4, 1.0, 0.8, 0.95, 40, 0.09, 0.3, max_new, seed,
                                          api_name="/generate")
        return details

    with ThreadPoolExecutor(max_workers=len(SESSIONS)) as pool:
        return list(pool.map(one, zip(clients, SESSIONS)))


def test_eight_concurrent_sessions_no_errors_no_cross_talk(playground_url):
    results = _eight_sessions(playground_url, [_client(playground_url) for _ in SESSIONS], 24)
    for (prompt, method, seed), details in zip(SESSIONS, results):
        assert details["error"] is None
        assert details["method"] == method
        assert details["token_ids"] == _direct(prompt, method, seed, 24), (prompt, method, seed)


@pytest.mark.slow
def test_eight_concurrent_sessions_on_the_default_pair(default_playground_url, default_pair):
    """The load test as deployed (SmolLM2-135M, the distilled draft): eight sessions at once, each with
    its own prompt and seed, get exactly what the engine gives for that request in this process, and
    each keeps its own × AR reference. The first four time AR alone first (a reference of their own);
    the last four never did, so they keep the start-up one; the concurrent runs are too short to
    become anyone's reference, so no session's reference can move."""
    from playground.runner import AR_REFERENCE_TOKENS

    clients = [_client(default_playground_url) for _ in SESSIONS]
    own = {}
    for i, (client, (prompt, _, seed)) in enumerate(zip(clients[:4], SESSIONS)):
        _, _, details, _, _ = client.predict(prompt, "ar", 4, 1.0, 0.8, 0.95, 40, 0.09, 0.3, AR_REFERENCE_TOKENS + 8,
                                          seed, api_name="/generate")
        assert details["metrics"]["new_tokens"] >= AR_REFERENCE_TOKENS, details["finish_reason"]
        own[i] = details["ar_reference"]
        assert own[i]["tokens_per_s"] == details["metrics"]["decode_tokens_per_s"]
        assert "your AR run" in own[i]["how"]
    max_new = 16
    assert max_new < AR_REFERENCE_TOKENS
    results = _eight_sessions(default_playground_url, clients, max_new)
    for i, ((prompt, method, seed), details) in enumerate(zip(SESSIONS, results)):
        assert details["error"] is None and details["method"] == method
        assert details["token_ids"] == _direct(prompt, method, seed, max_new, default_pair), (prompt, method, seed)
        if i in own:
            assert details["ar_reference"] == own[i], i
        else:
            assert "at start-up" in details["ar_reference"]["how"], (i, details["ar_reference"])


def test_ssd_through_the_api_is_greedy_lossless(playground_url):
    """The SSD method over HTTP (draft worker on its own core): greedy output equals plain AR."""
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("SSD needs two cores")
    args = ("The sea is", "ssd", 4, 1.0, 0.0, 1.0, 0, 0.09, 0.3, 16, 0, "sps", "geometric", 12, 1.0, "neural")
    _, status, details, _, _ = _client(playground_url).predict(*args, api_name="/generate")
    assert details["token_ids"] == _direct("The sea is", "ar", 0, 16, temperature=0.0)
    assert details["method"] == "ssd" and details["metrics"]["cache_lookups"] > 0
    assert "SSD cache hit rate" in status and "draft=cpu" in status


def test_ssd_fanout_and_c_change_while_paused(playground_url):
    """SSD's fan-out mode and C are live: set while the run is parked after round 0 (Pause armed, no
    timing), they are recorded once, exactly, and greedy output stays AR's. They take effect at round 2:
    the worker was asked for round 1's speculation during round 0, before the change."""
    client = _client(playground_url)
    args = ("The sea is", "ssd", 4, 1.0, 0.0, 1.0, 0, 0.09, 0.3, 24, 0, "sps", "uniform", 12, 1.0, "neural")
    assert "armed" in client.predict(api_name="/pause")
    job = client.submit(*args, api_name="/generate")
    _wait_for_output(job)
    assert "paused after round 0" in client.predict(api_name="/pause")
    assert "applies within two rounds" in client.predict("geometric", api_name="/set_ssd_fanout_mode")
    assert "applies within two rounds" in client.predict(0.5, api_name="/set_downweight_c")
    assert "paused after round 1" in client.predict(api_name="/step")
    client.predict(api_name="/resume")
    _, status, details, _, _ = job.result(timeout=120)
    assert details["finish_reason"] == "max_new_tokens", status
    assert details["config_changes"] == [{"round": 2, "token": details["config_changes"][0]["token"],
                                          "changes": {"ssd_fanout_mode": ["uniform", "geometric"],
                                                      "downweight_c": [1.0, 0.5]}}]
    assert details["token_ids"] == _direct("The sea is", "ar", 0, 24, temperature=0.0)


def _feed_messages(playground_url: str, feed_id: str, until) -> list[dict]:
    """The feed the page named `feed_id`, read from its opening (before or after its run starts)
    until a message satisfies `until` (then the stream is closed) or the feed ends."""
    import urllib.parse
    import urllib.request

    from playground.live_feed import feed_url

    read = []
    with urllib.request.urlopen(urllib.parse.urljoin(playground_url + "/", feed_url(feed_id)), timeout=60) as stream:
        for line in stream:
            if line.startswith(b"data: "):
                read.append(json.loads(line[len(b"data: "):]))
                if until(read[-1]) or read[-1].get("done"):
                    break
    return read


def test_a_run_on_the_live_feed_sends_gradio_its_final_update_only(playground_url):
    """The page names its feed at the click, so Gradio sends nothing until the final update: each
    Gradio update costs the browser's main thread tens of milliseconds on the engine's cores (an
    update at the first round naming a feed, and one restating the status line, were two). The feed
    is opened before the request reaches the server, as the page opens it. The session has run AR,
    so its first Cactus run needs no AR reference run before it."""
    client = _client(playground_url)
    ar = list(ARGS)
    ar[1], ar[9] = "ar", 32  # long enough to be the session's reference
    client.predict(*ar, api_name="/generate")
    feed_id = "c0ffee" * 5 + "00"
    read = []
    reader = threading.Thread(target=lambda: read.extend(_feed_messages(playground_url, feed_id, lambda m: False)))
    reader.start()
    job = client.submit(*ARGS, "sps", "uniform", 15, 1.0, "neural", feed_id, api_name="/generate")
    _, status, details, _, live = job.result(timeout=120)
    reader.join(timeout=120)
    assert details["finish_reason"] == "max_new_tokens" and live == "", status
    assert read[-1]["done"] and "next" not in read[-1]
    assert [t for m in read for t, _ in m["cells"]] and len(details["token_ids"]) == 24
    assert len(job.outputs()) == 1


def test_the_run_after_a_pages_ar_reference_run_follows_on_its_feed(playground_url):
    """A fresh session's first Cactus run from the page starts with the AR reference run on the
    page's feed; that feed's last message names the feed of the Cactus run, which carries its
    tokens; Gradio still sends the final update only."""
    client = _client(playground_url)
    feed_id = "5eed" * 8
    job = client.submit(*ARGS, "sps", "uniform", 15, 1.0, "neural", feed_id, api_name="/generate")
    reference = _feed_messages(playground_url, feed_id, lambda m: False)
    assert reference[-1]["done"] and reference[-1]["next"].endswith(feed_id + "-run")
    assert "AR reference run" in reference[-1]["status"]
    cactus = _feed_messages(playground_url, feed_id + "-run", lambda m: False)
    _, status, details, _, live = job.result(timeout=120)
    assert details["method"] == "cactus" and cactus[-1]["done"] and "next" not in cactus[-1], status
    assert [c for m in cactus for c in m["cells"]] and len(job.outputs()) == 1


def test_a_page_that_leaves_its_live_feed_stops_its_run(playground_url):
    """A click from the page names a live feed: the feed streams the run's tokens as server-sent
    events, and closing it before the run ends stops the run, as closing a Gradio stream does.
    Pause is armed, so the run is parked after round 0 while the feed is read: no timing."""
    client = _client(playground_url)
    feed_id = "1eave" + "0" * 27
    args = list(ARGS) + ["sps", "uniform", 15, 1.0, "neural", feed_id]  # SSD settings, then the feed
    args[9] = 256
    assert "armed" in client.predict(api_name="/pause")
    job = client.submit(*args, api_name="/generate")
    read = _feed_messages(playground_url, feed_id, lambda m: "paused" in m.get("status", ""))
    assert len([c for m in read for c in m["cells"]]) >= 1  # round 0's tokens
    _, status, details, _, live = job.result(timeout=120)
    assert details["finish_reason"] == "stopped" and live == "", status
    assert details["metrics"]["num_rounds"] == 1

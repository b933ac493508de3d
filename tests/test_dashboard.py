"""Phase 9: the engine dashboard (`GET /dashboard`, `GET /v1/engine/state` and its SSE stream).

The state is checked against what the engine must show: the blocks a running request holds (its block
table) are in use while it runs and free after; a prompt prefix hit in the prefix cache is one block held
by two requests (ref_cnt 2); a finished request's full blocks stay cached while free. The page itself is
driven in a real browser (Debian's chromium, headless, through selenium) against the real default model:
its grid shows blocks in use while a long request runs and none after, and its queues follow the engine.

    TINYVLLM_UPDATE_SCREENSHOT=1 .venv/bin/pytest tests/test_dashboard.py -k browser  # rewrites the screenshot
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from api_helpers import wait_for
from fake_engine import FakeLLMEngine

from tinyvllm.api.dashboard import DASHBOARD_PATHS, histogram_quantile
from tinyvllm.api.metrics import LATENCY_BUCKETS
from tinyvllm.api.launcher import BackgroundServer
from tinyvllm.api.server import build_app
from tinyvllm.engine.async_llm_engine import AsyncLLMEngine

KEY = "sk-dashboard"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "docs" / "images" / "dashboard.png"


def test_histogram_quantile_matches_numpy_within_a_bucket():
    rng = np.random.default_rng(0)
    samples = rng.lognormal(mean=-3.0, sigma=0.8, size=20_000)  # seconds: mostly 10-200 ms
    counts = [0] * (len(LATENCY_BUCKETS) + 1)
    for x in samples:
        counts[next((i for i, b in enumerate(LATENCY_BUCKETS) if x <= b), len(LATENCY_BUCKETS))] += 1
    for q in (0.5, 0.9, 0.99):
        estimate, exact = histogram_quantile(q, LATENCY_BUCKETS, counts), np.quantile(samples, q)
        i = next(i for i, b in enumerate(LATENCY_BUCKETS) if exact <= b)  # the bucket holding the true quantile
        low = LATENCY_BUCKETS[i - 1] if i else 0.0
        assert low <= estimate <= LATENCY_BUCKETS[i], (q, estimate, exact)
    assert histogram_quantile(0.5, LATENCY_BUCKETS, [0] * len(counts)) is None
    assert histogram_quantile(0.99, (1.0, 2.0), [0, 0, 5]) == 2.0  # above the last bound: that bound


# ---- the routes, around the fake engine (no model: milliseconds) ----

@pytest.fixture(scope="module")
def fake_server():
    engine = AsyncLLMEngine(lambda: FakeLLMEngine(step_time=0.01), max_waiting=16)
    with BackgroundServer(build_app(engine, api_key=KEY), timeout=120) as server:
        yield server


def test_page_is_public_and_served_by_the_server(fake_server):
    for path in DASHBOARD_PATHS:
        response = httpx.get(fake_server.url + path)
        assert response.status_code == 200, path
    page = httpx.get(fake_server.url + "/dashboard").text
    # everything it loads comes from this server: no scheme or host in any src or href
    assert 'src="/dashboard/dashboard.js"' in page and 'href="/dashboard/dashboard.css"' in page
    for name in ("dashboard.html", "dashboard.js", "dashboard.css"):
        assert "://" not in httpx.get(f"{fake_server.url}/dashboard/{name}").text, name
    assert httpx.get(fake_server.url + "/dashboard/server.py", headers=AUTH).status_code == 404


def test_state_needs_the_key(fake_server):
    for path in ("/v1/engine/state", "/v1/engine/state/stream"):
        response = httpx.get(fake_server.url + path)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer", path
    state = httpx.get(fake_server.url + "/v1/engine/state", headers=AUTH).json()
    assert state["stats"]["num_total_blocks"] == 64 and state["server"]["draining"] is False
    assert {"generation_tok_s", "prompt_tok_s", "ttft_p50_ms", "itl_p99_ms", "prefix_cache_hit_rate"} <= set(
        state["rates"])
    assert "spec_decode_acceptance_rate" not in state["rates"]  # the engine has no speculative decoding


def test_stream_follows_a_request(fake_server):
    """The SSE stream: one snapshot per interval; the rates see the tokens a request generated."""
    body = {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True}
    request = threading.Thread(target=httpx.post, args=(fake_server.url + "/v1/completions",),
                               kwargs={"json": body, "headers": AUTH, "timeout": 60})
    running_seen, events = False, 0
    with httpx.stream("GET", fake_server.url + "/v1/engine/state/stream", params={"interval": 0.05},
                      headers=AUTH, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            state, events = json.loads(line[len("data: "):]), events + 1
            if events == 1:
                request.start()
            running_seen |= state["stats"]["num_running"] == 1
            if running_seen and state["stats"]["num_running"] == 0:
                break
    request.join()
    assert running_seen and events >= 3
    rates = httpx.get(fake_server.url + "/v1/engine/state", headers=AUTH).json()["rates"]
    assert rates["generation_tokens_total"] >= 40 and rates["itl_p50_ms"] is not None


def test_remote_dashboard_passes_the_calls_on(fake_server):
    """python -m tinyvllm.dashboard --url: the page here, the data from the server (the key added here)."""
    from tinyvllm.dashboard import build_app as build_remote_app
    from tinyvllm.dashboard import check_url

    with pytest.raises(ValueError, match="http"):
        check_url("ftp://example.com")
    with BackgroundServer(build_remote_app(fake_server.url, api_key=KEY), wait_until_ready=False) as local:
        assert httpx.get(local.url + "/dashboard").text == httpx.get(fake_server.url + "/dashboard").text
        assert httpx.get(local.url + "/v1/engine/state").json()["stats"]["num_total_blocks"] == 64
        with httpx.stream("GET", local.url + "/v1/engine/state/stream", timeout=30) as response:
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["stats"]["num_total_blocks"] == 64
    with BackgroundServer(build_remote_app(fake_server.url), wait_until_ready=False) as local:  # no key here
        assert httpx.get(local.url + "/v1/engine/state").status_code == 401
        assert httpx.get(local.url + "/v1/engine/state", headers=AUTH).status_code == 200  # the page's key


# ---- the engine's state: a tiny random model through the real scheduler and block manager ----

@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from tinyvllm.engine.llm_engine import LLMEngine

    return LLMEngine(tiny_model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                     num_gpu_blocks_override=48, block_size=16)


def test_state_shows_owned_shared_and_cached_blocks(tiny_engine):
    from tinyvllm.sampling_params import SamplingParams

    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks + 8
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    tiny_engine.add_request("first", prompt, params)
    tiny_engine.step()  # first's prompt computed: its 2 full blocks enter the prefix cache
    tiny_engine.add_request("second", prompt + [7, 8], params)
    tiny_engine.step()
    state = tiny_engine.get_state()
    running = {r["request_id"]: r for r in state["running"]}
    first, second = running["first"]["block_table"], running["second"]["block_table"]
    assert first[:2] == second[:2] and running["second"]["num_cached_tokens"] == 32  # the shared prefix
    ref_cnt, cached = state["kv_cache"]["ref_cnt"], state["kv_cache"]["cached"]
    assert [ref_cnt[b] for b in first[:2]] == [2, 2] and [cached[b] for b in first[:2]] == [1, 1]
    assert all(ref_cnt[b] == 1 for b in set(first[2:]) | set(second[2:]))
    in_use = {b for b in range(len(ref_cnt)) if ref_cnt[b]}
    assert in_use == set(first) | set(second)  # every block in use is in some block table
    steps = state["steps"]
    assert steps[0]["num_prefill_tokens"] == 40 and steps[0]["num_decode_tokens"] == 0
    assert steps[1]["num_prefill_tokens"] == 42 - 32 and steps[1]["num_decode_tokens"] == 1
    assert steps[1]["batch_size"] == 2 and state["config"]["num_blocks"] == 48
    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
    state = tiny_engine.get_state()
    assert sum(state["kv_cache"]["ref_cnt"]) == 0 and not state["running"] and not state["waiting"]
    assert state["kv_cache"]["cached"][first[0]] == 1  # free, and still a prefix a new prompt may hit
    assert state["kv_cache"]["num_free_blocks"] == 48
    assert state["encoder_cache"] is None  # a text model: the page hides the panel


# ---- the page, in a real browser, against the real default model ----

def chromium() -> tuple[str, str]:
    """Paths of Debian's chromium and chromedriver, or skip saying why there are none."""
    pytest.importorskip("selenium", reason="selenium is not installed: pip install -e '.[test]'")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("chromium and chromedriver are not installed (`make setup-test` installs Debian's chromium and "
                    "chromium-driver with apt-get; they could not be installed on this machine)")
    return browser, driver


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    profile = Path(os.environ.get("TMPDIR", "/tmp")) / f"tinyvllm-chromium-{os.getpid()}"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.slow
def test_browser_shows_the_engine_live(browser, tmp_path):
    from selenium.webdriver.common.by import By

    from tinyvllm.engine.llm_engine import LLMEngine

    def make_engine():  # two sequences at once, so a third request waits
        return LLMEngine(max_model_len=512, max_num_seqs=2, max_num_batched_tokens=64, num_gpu_blocks_override=64)

    engine = AsyncLLMEngine(make_engine, max_waiting=16)
    with BackgroundServer(build_app(engine, api_key=KEY), timeout=600) as server:
        browser.get(f"{server.url}/dashboard#key={KEY}")
        text = lambda element_id: browser.find_element(By.ID, element_id).text  # noqa: E731
        attribute = lambda element_id, name: browser.find_element(By.ID, element_id).get_attribute(name)  # noqa: E731
        wait_for(lambda: attribute("status", "data-state") == "live", 60, "the page to connect")
        assert "key=" not in browser.current_url  # the key left the address bar for localStorage
        assert "SmolLM2" in text("cfg-model") and text("cfg-device") and text("cfg-kv-dtype")
        wait_for(lambda: attribute("blocks", "data-used") == "0", 30, "the grid")
        num_blocks = len(browser.find_elements(By.CSS_SELECTOR, "#blocks .block"))
        assert num_blocks == engine.engine.scheduler.block_manager.num_blocks
        assert not browser.find_element(By.ID, "encoder-panel").is_displayed()  # a model without images

        system = "You are a terse assistant. Answer in one short sentence, and never use lists. " * 3
        warm_up = {"prompt": system + "Q: Hi.", "max_tokens": 4, "temperature": 0}  # compiles; caches the prefix
        assert httpx.post(f"{server.url}/v1/completions", json=warm_up, headers=AUTH, timeout=300).status_code == 200
        bodies = [{"prompt": system + question, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
                  for question, tokens in (("Q: Name a colour.", 160), ("Q: Name a fruit.", 120),
                                           ("Q: Name a city.", 60))]
        results = []
        threads = [threading.Thread(target=lambda b=b: results.append(httpx.post(
            f"{server.url}/v1/completions", json=b, headers=AUTH, timeout=300))) for b in bodies]
        for thread in threads:
            thread.start()
            time.sleep(0.3)  # in order: the third waits behind the first two
        rows = lambda queue: len(browser.find_elements(By.CSS_SELECTOR, f"#{queue} tbody tr"))  # noqa: E731
        wait_for(lambda: rows("running") == 2 and rows("waiting") == 1, 120, "two running, one waiting")
        wait_for(lambda: int(attribute("blocks", "data-used")) > 0 and text("rate-generation") not in ("-", "0.0"),
                 60, "blocks in use and a generation rate")
        shared = browser.find_elements(By.CSS_SELECTOR, "#blocks .block.shared")
        assert shared, "the two requests share their system prompt's blocks (prefix caching): ref_cnt 2"
        assert "Q4_1" in text("cfg-quantization")  # the shipped GGUF's linears
        wait_for(lambda: int(text("steps-summary").split()[0]) >= 60, 120, "steps to fill the chart")
        path = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(path)) and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("TINYVLLM_UPDATE_SCREENSHOT"):
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, SCREENSHOT)

        wait_for(lambda: rows("waiting") == 0 and rows("running") >= 1, 120, "the waiting request to be admitted")
        for thread in threads:
            thread.join(300)
        assert [r.status_code for r in results] == [200, 200, 200]
        wait_for(lambda: rows("running") == 0 and attribute("blocks", "data-used") == "0", 30,
                 "the grid to show no block in use")
        assert browser.find_elements(By.CSS_SELECTOR, "#blocks .block.cached"), "finished prompts stay cached"
        assert int(text("steps-summary").split()[0]) > 100

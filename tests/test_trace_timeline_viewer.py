"""The trace timeline viewer on dumps whose traces the test wrote by hand in slime's layout
(slime.observability.trace_utils: span_start / span_end / event records, each with its
trace_id, sample_id, group_id, attempt, span ids and attrs)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import urllib.request

import pytest
import torch

from slime.rollout.dump import save_dump
from slime.tools.trace_timeline_viewer import main, timeline_paths

T0 = 1_767_000_000.0  # an epoch time, as trace_utils records (time.time())
SGLANG_META = {
    "prompt_tokens": 12,
    "completion_tokens": 9,
    "cached_tokens": 4,
    "queue_time": 0.004,
    "e2e_latency": 0.5,
    "finish_reason": "stop",
}


def _event(sample: int, kind: str, name: str, at: float, span=None, parent=None, attrs=None) -> dict:
    event = {
        "type": kind,
        "name": name,
        "ts": T0 + at,
        "trace_id": f"trace-{sample}",
        "sample_id": sample,
        "group_id": 0,
        "attempt": 0,
    }
    for key, value in (("span_id", span), ("parent_span_id", parent), ("attrs", attrs)):
        if value is not None:
            event[key] = value
    return event


def _trace(sample: int, at: float, partial: bool = False) -> dict:
    """generate_and_rm_group > generate_and_rm > (sglang_generate, reward_model > reward_ready);
    `partial`: the rollout stopped inside sglang_generate (nothing ended) and a span_end whose
    start is missing."""
    group, gen_rm, sglang, reward = (f"{sample}-{name}" for name in ("group", "gen_rm", "sglang", "rm"))
    events = [
        _event(sample, "span_start", "generate_and_rm_group", at, group, attrs={"group_size": 2}),
        _event(sample, "span_start", "generate_and_rm", at + 0.01, gen_rm, parent=group),
        _event(sample, "span_start", "sglang_generate", at + 0.02, sglang, gen_rm, {"max_new_tokens": 16}),
    ]
    if partial:
        events += [
            _event(sample, "event", "abort", at + 0.3, parent=sglang, attrs={"reason": "timeout"}),
            _event(sample, "span_end", "reward_model", at + 0.35, "lost-span"),
        ]
    else:
        events += [
            _event(sample, "span_end", "sglang_generate", at + 0.52, sglang, attrs=SGLANG_META),
            _event(sample, "span_start", "reward_model", at + 0.53, reward, parent=gen_rm),
            # no parent_span_id: the viewer takes the innermost open span (reward_model)
            _event(sample, "event", "reward_ready", at + 0.6, attrs={"reward": 1.0}),
            _event(sample, "span_end", "reward_model", at + 0.61, reward),
            _event(sample, "span_end", "generate_and_rm", at + 0.62, gen_rm, attrs={"response_length": 9}),
            _event(sample, "span_end", "generate_and_rm_group", at + 0.7, group),
        ]
    return {
        "version": 1,
        "trace_id": f"trace-{sample}",
        "sample_id": sample,
        "group_id": 0,
        "attempt": 0,
        "events": events,
    }


def _sample(index: int, trace: dict | None) -> dict:
    sample = {
        "index": index,
        "group_index": 0,
        "tokens": [1, 2, 3],
        "response_length": 1,
        "reward": float(index != 2),
        "status": "completed",
        "label": "4",
        "metadata": {"source": "gsm8k"},
    }
    return sample if trace is None else {**sample, "trace": trace}


@pytest.fixture
def dump(tmp_path) -> str:
    samples = [_sample(0, _trace(0, 0.0)), _sample(1, _trace(1, 0.05)), _sample(2, _trace(2, 0.1, True))]
    return save_dump(str(tmp_path / "rollout_{rollout_id}.pt"), 0, samples, {})


def test_cache_has_one_row_per_sample_with_nested_spans_and_events(dump, capsys):
    assert main([dump, "--no-serve"]) == 0
    paths = timeline_paths(dump)
    assert paths.cache.endswith("rollout_0.trace_timeline_cache.json")
    assert paths.html.endswith("rollout_0.trace_timeline_viewer.html")
    assert "samples: 3 traced of 3" in capsys.readouterr().out
    with open(paths.cache) as f:
        cache = json.load(f)
    assert (cache["cache_version"], cache["sample_count"], cache["pt_path"]) == (1, 3, dump)
    assert [r["sample_index"] for r in cache["rows"]] == [0, 1, 2]
    assert cache["global_start"] == pytest.approx(T0) and cache["global_end"] == pytest.approx(T0 + 0.75)

    row = cache["rows"][0]
    spans = {i["name"]: i for i in row["items"] if i["type"] == "span"}
    assert {n: s["depth"] for n, s in spans.items()} == {
        "generate_and_rm_group": 0,
        "generate_and_rm": 1,
        "sglang_generate": 2,
        "reward_model": 2,
    }
    times = [(s["start_ts"] - T0, s["end_ts"] - T0, s["duration"]) for s in spans.values()]
    expected = [(0.0, 0.7, 0.7), (0.01, 0.62, 0.61), (0.02, 0.52, 0.5), (0.53, 0.61, 0.08)]
    assert [t for row_times in times for t in row_times] == pytest.approx(sum(expected, ()), abs=1e-5)
    sglang = spans["sglang_generate"]
    assert sglang["attrs"] == {"start_attrs": {"max_new_tokens": 16}, "end_attrs": SGLANG_META}
    assert (sglang["state"], sglang["parent_span_name"], sglang["lane"]) == (
        "closed_span",
        "generate_and_rm",
        2,
    )
    [point] = [i for i in row["items"] if i["type"] == "event"]
    assert (point["name"], point["parent_span_name"], point["depth"]) == ("reward_ready", "reward_model", 3)
    assert point["ts"] == pytest.approx(T0 + 0.6) and point["attrs"] == {"reward": 1.0}
    assert (
        row["lane_count"],
        row["closed_span_count"],
        row["point_event_count"],
        row["open_span_count"],
    ) == (4, 4, 1, 0)
    assert [i["lane"] for i in row["items"]] == sorted(i["lane"] for i in row["items"])
    assert cache["rows"][1]["start"] == pytest.approx(T0 + 0.05)
    assert (row["total_response_length"], row["max_response_length"], row["source"]) == (9, 9, "gsm8k")


def test_partial_trace_draws_open_spans_to_the_last_event_and_keeps_unmatched_ends(dump):
    assert main([dump, "--no-serve"]) == 0
    with open(timeline_paths(dump).cache) as f:
        row = json.load(f)["rows"][2]
    assert (row["open_span_count"], row["orphan_count"], row["closed_span_count"]) == (3, 1, 0)
    opened = [i for i in row["items"] if i["state"] == "open_span"]
    assert [i["name"] for i in opened] == ["generate_and_rm_group", "generate_and_rm", "sglang_generate"]
    for span in opened:  # nothing ended them: each runs to the row's last event (the orphan end)
        assert span["end_ts"] is None and span["display_end_ts"] == pytest.approx(T0 + 0.45)
        assert span["attrs"]["end_attrs"] == {"clipped_by": "row_end"}
    [orphan] = [i for i in row["items"] if i["state"] == "orphan_end"]
    assert (orphan["name"], orphan["span_id"], orphan["depth"]) == ("reward_model", "lost-span", 3)


def test_page_is_self_contained_and_embeds_the_cache(dump):
    assert main([dump, "--no-serve"]) == 0
    with open(timeline_paths(dump).html) as f:
        page = f.read()
    assert "rollout_0.pt trace timeline" in page and '"e2e_latency":0.5' in page
    assert "http://" not in page and "https://" not in page and "<script src" not in page
    assert 'id="notice"' not in page
    assert not [n for n in os.listdir(os.path.dirname(dump)) if n.startswith(".tmp")]
    dump_mode = stat.S_IMODE(os.stat(dump).st_mode) & 0o666
    assert stat.S_IMODE(os.stat(timeline_paths(dump).html).st_mode) == dump_mode


def test_cache_is_reused_while_newer_than_the_dump(dump):
    assert main([dump, "--no-serve"]) == 0
    cache = timeline_paths(dump).cache
    with open(cache) as f:
        first = json.load(f)["generated_at"]
    assert main([dump, "--no-serve"]) == 0
    with open(cache) as f:
        assert json.load(f)["generated_at"] == first
    assert main([dump, "--no-serve", "--rebuild"]) == 0
    with open(cache) as f:
        assert json.load(f)["generated_at"] > first


def test_dump_without_traces_gives_a_page_that_says_so(tmp_path, capsys):
    path = str(tmp_path / "plain.pt")  # slime's own dump layout: rollout_id and samples only
    torch.save({"rollout_id": 3, "samples": [_sample(0, None), _sample(1, {"events": []})]}, path)
    assert main([path, "--no-serve"]) == 0
    out = capsys.readouterr().out
    assert "No traces in plain.pt: none of its 2 samples carries trace events" in out
    with open(timeline_paths(path).html) as f:
        assert '<p id="notice">No traces in plain.pt' in f.read()
    with open(timeline_paths(path).cache) as f:
        assert json.load(f)["rows"] == []


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "no such file (expected a rollout dump (.pt) written by --save-debug-rollout-data)"),
        (b"not a dump", "torch.load(weights_only=True) failed"),
        (torch.zeros(2), "expected a dict with a 'samples' list, found Tensor"),
        ({"rollout_id": 0}, "expected a dict with a 'samples' list, found dict"),
        ({"rollout_id": 0, "samples": [1]}, "sample 0 is a int, expected a dict"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, content, expected):
    path = str(tmp_path / "x.pt")
    if isinstance(content, bytes):
        (tmp_path / "x.pt").write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    assert main([path, "--no-serve"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and path in err and expected in err
    assert not os.path.exists(timeline_paths(path).html) and not os.path.exists(timeline_paths(path).cache)


def test_a_retry_is_no_part_of_the_attempt_it_replaced():
    """Attempt 0 left its span open (its engine died); attempt 1's spans, recorded after, are its
    siblings, not its children, and the open span is drawn up to where attempt 1 began."""
    from slime.tools.trace_timeline_viewer import build_row

    events = [
        {"type": "span_start", "name": "generate_and_rm", "ts": T0, "span_id": "a0", "attempt": 0},
        {"type": "span_start", "name": "generate_and_rm", "ts": T0 + 0.3, "span_id": "a1", "attempt": 1},
        {"type": "event", "name": "retried", "ts": T0 + 0.35, "attempt": 1},
        {"type": "span_end", "name": "generate_and_rm", "ts": T0 + 0.5, "span_id": "a1", "attempt": 1},
    ]
    row = build_row({"trace": {"events": events}}, 0)
    assert row is not None
    spans = {(i["attempt"], i["name"]): i for i in row["items"] if i["type"] == "span"}
    assert spans[(1, "generate_and_rm")]["parent_span_id"] is None
    assert spans[(0, "generate_and_rm")]["display_end_ts"] == pytest.approx(T0 + 0.3)
    assert spans[(0, "generate_and_rm")]["attrs"]["end_attrs"] == {"clipped_by": "next_sibling_start"}
    [point] = [i for i in row["items"] if i["type"] == "event"]
    assert point["parent_span_id"] == "a1"


# The viewer as a terminal starts it, with Ctrl-C's SIGINT at Python's default even where these
# tests run with it ignored (a background job of a non-interactive shell: its children inherit
# that, and Python keeps an ignored SIGINT ignored).
VIEWER_AT_A_TERMINAL = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('slime.tools.trace_timeline_viewer', run_name='__main__', alter_sys=True)"
)


def test_serves_the_page_on_loopback_until_interrupted(dump):
    proc = subprocess.Popen(
        [sys.executable, "-c", VIEWER_AT_A_TERMINAL, dump, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [proc.stdout.readline() for _ in range(4)]
        assert lines[-1].startswith("serving http://"), (
            lines,
            proc.poll() is not None and proc.stderr.read(),
        )
        url = lines[-1].split()[1]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/rollout_0.trace_timeline_viewer.html")
        with urllib.request.urlopen(url, timeout=30) as response:
            page = response.read().decode()
        assert response.status == 200 and '"e2e_latency":0.5' in page
        for other in (
            "rollout_0.pt",
            "rollout_0.trace_timeline_cache.json",
            "",
        ):  # the dump's folder stays private
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url.rsplit("/", 1)[0] + "/" + other, timeout=30)
            assert refused.value.code == 404
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


CHROMIUM, CHROMEDRIVER = shutil.which("chromium") or "/usr/bin/chromium", shutil.which("chromedriver") or ""


def _browser():
    """Headless Chromium through Selenium, or a skip naming what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("no chromium and chromedriver here (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1400,700",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    return webdriver.Chrome(options=options, service=service), profile


def test_page_in_a_browser_shows_rows_and_the_attrs_of_a_clicked_span(dump, tmp_path):
    assert main([dump, "--no-serve"]) == 0
    driver, profile = _browser()
    try:
        from selenium.webdriver.common.by import By

        driver.get("file://" + timeline_paths(dump).html)
        rows = driver.find_elements(By.CSS_SELECTOR, "#rows .row")
        assert [r.get_attribute("data-sample") for r in rows] == ["0", "1", "2"]
        rows[0].find_element(By.CSS_SELECTOR, '.bar[data-name="sglang_generate"]').click()
        details = driver.find_element(By.ID, "details").text
        assert "sglang_generate" in details and "e2e_latency" in details and "queue_time" in details
        assert "max_new_tokens" in details and "generate_and_rm" in details  # start attrs, parent
        rows[2].find_element(By.CSS_SELECTOR, '.bar[data-name="sglang_generate"]').click()
        assert "Open: a span_start without its span_end" in driver.find_element(By.ID, "details").text
        rows[0].find_element(By.CSS_SELECTOR, '.point[data-name="reward_ready"]').click()
        assert "reward_model" in driver.find_element(By.ID, "details").text
        assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        untraced = str(tmp_path / "untraced.pt")
        torch.save({"rollout_id": 0, "samples": [_sample(0, None)]}, untraced)
        assert main([untraced, "--no-serve"]) == 0
        driver.get("file://" + timeline_paths(untraced).html)
        assert "No traces in untraced.pt" in driver.find_element(By.ID, "notice").text
        assert not driver.find_elements(By.CSS_SELECTOR, "#rows .row")
        assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)

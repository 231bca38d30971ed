"""The live dashboard on the observed cluster (``tests/observed.py``: two replicas, API keys
on): ``/dashboard`` asks a browser for the key (Basic, the key as the password) and serves
its page and whitelisted static files; headless Chromium, loading it while chat requests
run, sees it poll, chart every replica's live numbers and log no error."""

from __future__ import annotations

import base64
import threading
import time
from pathlib import Path

import httpx
import pytest
from observed import KEY, MODEL, Observed

from bench.harness.browser import CHROMIUM, Browser
from cluster.api.auth import given_key

SYSTEM = "You keep the harbour's ledger: every ship, its cargo and its berth. " * 20
LOAD_S = 10.0


def basic(key: str) -> dict[str, str]:
    token = base64.b64encode(f"dashboard:{key}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


@pytest.mark.parametrize(
    ("header", "key"),
    [
        ("Bearer k1", b"k1"),
        (basic("k1")["Authorization"], b"k1"),
        ("Basic " + base64.b64encode(b":k:with:colons").decode(), b"k:with:colons"),
        ("Basic " + base64.b64encode(b"no-colon").decode(), None),
        ("Basic not*base64", None),
        ("Basic \u00e9", None),
        ("Digest k1", None),
        ("", None),
    ],
)
def test_the_key_a_header_carries(header: str, key: bytes | None) -> None:
    assert given_key(header) == key


def test_the_dashboard_asks_a_browser_for_the_key_and_serves_its_files(
    observed: Observed,
) -> None:
    url = f"{observed.base_url}/dashboard"
    refused = httpx.get(url)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"].startswith("Basic ")
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers=basic("wrong")).status_code == 401
    page = httpx.get(url, headers=basic(KEY))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache" and "dashboard.js" in page.text
    types = {
        "dashboard.js": "text/javascript",
        "dashboard.css": "text/css",
        "uPlot.iife.min.js": "text/javascript",
        "uPlot.min.css": "text/css",
        "LICENSE.uPlot": "text/plain",
    }
    for name, media_type in types.items():
        static = httpx.get(f"{url}/static/{name}", headers=basic(KEY))
        assert static.status_code == 200, name
        assert static.headers["content-type"].startswith(media_type), name
    missing = httpx.get(f"{url}/static/secrets.txt", headers=basic(KEY))
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    # a Basic password is a key everywhere, and a Bearer key opens the dashboard too; the
    # API's 401 stays without the browser's challenge
    stats = httpx.get(f"{observed.base_url}/cluster/stats", headers=basic(KEY))
    assert stats.status_code == 200
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url, headers=bearer).status_code == 200
    api_refused = httpx.get(f"{observed.base_url}/v1/models")
    assert api_refused.status_code == 401 and "www-authenticate" not in api_refused.headers


def send_chats(observed: Observed, stop: threading.Event, done: list[str]) -> None:
    """Chat requests sharing a long system prompt, one after another, until ``stop``."""
    client = observed.client()
    deadline = time.monotonic() + LOAD_S
    turn = 0
    while not stop.is_set() and time.monotonic() < deadline:
        turn += 1
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Which ship is at berth {turn}?"},
            ],
            max_tokens=16,
            temperature=0.0,
        )
        done.append(reply.id)


def decisions_missing(observed: Observed) -> bool:
    """Whether the ingress has no ``/cluster/decisions`` yet (the page then reads its 404
    as "no decisions", which the browser itself still logs)."""
    bearer = {"Authorization": f"Bearer {KEY}"}
    answer = httpx.get(f"{observed.base_url}/cluster/decisions?limit=1", headers=bearer)
    return answer.status_code == 404


# every replica's numbers, charted, with a prompt already counted: the page is live
LIVE = """(() => {
  const d = window.dashboard;
  if (!d || d.polls < 3 || d.replicas < 2) return false;
  const counted = Object.values(d.series.replicas).some(
    (r) => r.prompt_tokens.some((v) => v > 0));
  const charts = [...document.querySelectorAll("[data-chart]")];
  const drawn = charts.every((c) => c.querySelector("canvas"));
  return counted && drawn && charts.length >= 1 + 3 * d.replicas ? charts.length : false;
})()"""


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="scripts/ensure-system.sh test")
def test_headless_chromium_sees_the_dashboard_poll_and_chart_live_numbers(
    observed: Observed,
) -> None:
    stop = threading.Event()
    done: list[str] = []
    failed: list[BaseException] = []

    def load() -> None:
        try:
            send_chats(observed, stop, done)
        except BaseException as exc:  # raised in the test below
            failed.append(exc)

    sender = threading.Thread(target=load, daemon=True)
    sender.start()
    try:
        with Browser() as browser:
            page = browser.open(f"{observed.base_url}/dashboard", ("dashboard", KEY))
            charts = page.wait_for(LIVE, timeout_s=40)
            polls = page.evaluate("window.dashboard.polls")
            page.wait_for(f"window.dashboard.polls >= {polls + 2}", timeout_s=10)
            summary = page.evaluate("document.getElementById('summary').textContent")
            errors = page.console_errors
    finally:
        stop.set()
        sender.join(timeout=60)
    assert not failed, failed
    assert done  # the load ran
    assert charts >= 7 and "policy" in summary and "round_robin" in summary
    if decisions_missing(observed):
        errors = [e for e in errors if "/cluster/decisions" not in e]
    assert errors == []

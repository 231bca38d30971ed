"""A real Prometheus scraping the observed cluster (tests/observed.py) with its API key, the
deploy/prometheus rules loaded: the reuse ledger it reads agrees exactly with what the
responses' ``x-prefix-reuse`` headers added up to, and its rules evaluate without error."""

from __future__ import annotations

import re
import time
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest
from observed import KEY, MODEL, Observed

from bench.assistant_prompts import SUPPORT_QUESTIONS, SUPPORT_SYSTEM_PROMPT
from bench.harness.prometheus import PrometheusServer, binary

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
RULE_FILES = [DEPLOY / "recording_rules.yml", DEPLOY / "alert_rules.yml"]
REUSE = re.compile(r"^reusable=(\d+|unknown); routed=(\d+); delivered=(\d+)$")
DELIVERED = "sum(prefix_serve_reuse_delivered_tokens_total)"
REUSABLE = "sum(prefix_serve_reuse_reusable_tokens_total)"
REQUESTS = 6

try:
    binary("prometheus")
    HAVE_PROMETHEUS = True
except RuntimeError:
    HAVE_PROMETHEUS = False
pytestmark = pytest.mark.skipif(
    not HAVE_PROMETHEUS, reason="prometheus not installed (scripts/ensure-system.sh test)"
)


def chat_reuse(client: openai.OpenAI, question: str) -> tuple[int, int, int] | None:
    """One chat request under the long shared system prompt: its header's ledger (None:
    ``reusable`` unknown, the index's answer never came: not counted in /metrics either)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": SUPPORT_SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ],
        max_tokens=4,
        temperature=0,
    )
    raw.parse()
    header = raw.headers.get("x-prefix-reuse")
    assert header is not None, dict(raw.headers)
    match = REUSE.match(header.strip())
    assert match is not None, header
    if match.group(1) == "unknown":
        return None
    reusable, routed, delivered = (int(g) for g in match.groups())
    return reusable, routed, delivered


def totals(prom: PrometheusServer) -> tuple[float, float]:
    """The cluster's delivered and reusable tokens, as Prometheus last scraped them."""
    return prom.value(DELIVERED) or 0.0, prom.value(REUSABLE) or 0.0


def wait_for_totals(prom: PrometheusServer, want: tuple[float, float], timeout_s: float) -> None:
    """Until Prometheus's totals are ``want`` (another ingress's share lags a few seconds)."""
    deadline = time.monotonic() + timeout_s
    while totals(prom) != want and time.monotonic() < deadline:
        time.sleep(0.5)


def test_prometheus_reads_the_ledger_the_headers_counted(observed: Observed) -> None:
    target = urlparse(observed.base_url).netloc
    with PrometheusServer(
        targets=[target], bearer_token=KEY, scrape_interval_s=1, rule_files=RULE_FILES
    ) as prom:
        prom.wait_for_scrape(timeout_s=30)
        before = totals(prom)  # the shared cluster may have served other tests already

        client = observed.client()
        answers = [chat_reuse(client, SUPPORT_QUESTIONS[i]) for i in range(REQUESTS)]
        ledger = [a for a in answers if a is not None]
        reusable = sum(r for r, _, _ in ledger)
        delivered = sum(d for _, _, d in ledger)
        assert reusable > 0 and delivered > 0, answers  # the shared prompt was reused

        prom.wait_for_scrape(timeout_s=30, after=time.time())
        want = (before[0] + delivered, before[1] + reusable)
        wait_for_totals(prom, want, timeout_s=20)
        after = totals(prom)
        assert (after[0] - before[0], after[1] - before[1]) == (delivered, reusable), ledger
        seen = (after[0] - before[0]) / (after[1] - before[1])
        assert seen == pytest.approx(delivered / reusable, rel=0, abs=1e-9)
        ratio = prom.value(f"{DELIVERED} / {REUSABLE}")  # the cluster's whole ledger
        assert ratio == pytest.approx(after[0] / after[1], rel=0, abs=1e-9)
        if before == (0.0, 0.0):  # a cluster that served only these: the very ratio
            assert ratio == pytest.approx(delivered / reusable, rel=0, abs=1e-9)

        check_rules(prom)


def check_rules(prom: PrometheusServer) -> None:
    """Both rule files loaded, every rule evaluated with health "ok"."""
    deadline = time.monotonic() + 20
    while True:
        rules = prom.rules()
        evaluated = all(r.get("health") != "unknown" for r in rules)
        if (rules and evaluated) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {Path(r["file"]).name for r in rules} == {p.name for p in RULE_FILES}
    names = {r["name"] for r in rules}
    assert "prefix_serve:reuse_captured:ratio_rate5m" in names
    assert "PrefixServeReplicaIndexEventsLost" in names
    bad = {r["name"]: (r.get("health"), r.get("lastError")) for r in rules if r["health"] != "ok"}
    assert bad == {}

"""deploy/prometheus, checked without a cluster: Prometheus's own tool accepts the config and
the rules, the rules' unit tests pass, every rule and alert is tested there, every metric
they name is one the code exports (a renamed metric fails here, not in production). A real
Prometheus scraping a real cluster with its key and evaluating the rules:
``test_observe_prometheus.py``."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from bench.harness.prometheus import promtool
from cluster.api import metrics as api_metrics
from router import routing_stats

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "prometheus"
RULE_FILES = ("recording_rules.yml", "alert_rules.yml")
# the series name forms a Prometheus client family exports, by its type
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}
METRIC = re.compile(r"\bprefix_serve_[a-z0-9_]+")
RECORDED = re.compile(r"\bprefix_serve:[a-z0-9_:]+")

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None and not Path("/usr/bin/promtool").exists(),
    reason="promtool not installed (scripts/ensure-system.sh test)",
)


def rules(name: str) -> list[dict[str, Any]]:
    groups = yaml.safe_load((DEPLOY / name).read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def all_rules() -> list[dict[str, Any]]:
    return [rule for name in RULE_FILES for rule in rules(name)]


def collectors() -> Iterator[MetricWrapperBase]:
    for module in (api_metrics, routing_stats):
        for value in vars(module).values():
            found = value.values() if isinstance(value, dict) else [value]
            yield from (v for v in found if isinstance(v, MetricWrapperBase))


def families() -> set[tuple[str, str]]:
    """Every metric family the code exports: (name, type)."""
    return {(c._name, c._type) for c in collectors()}


def exported_series() -> set[str]:
    """Every series name those families export."""
    return {name + suffix for name, kind in families() for suffix in SUFFIXES[kind]}


def ok(result: Any) -> str:
    return f"rc {result.returncode}\n{result.stdout}\n{result.stderr}"


def test_promtool_accepts_the_config_and_its_rule_files() -> None:
    result = promtool("check", "config", "prometheus.yml", cwd=DEPLOY)
    assert result.returncode == 0, ok(result)
    assert f"{len(RULE_FILES)} rule files found" in result.stdout + result.stderr
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert config["rule_files"] == list(RULE_FILES)
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "prefix-serve" and job["metrics_path"] == "/metrics"


@pytest.mark.parametrize("name", RULE_FILES)
def test_promtool_accepts_the_rules(name: str) -> None:
    result = promtool("check", "rules", name, cwd=DEPLOY)
    assert result.returncode == 0, ok(result)


def test_the_rules_unit_tests_pass() -> None:
    result = promtool("test", "rules", "rules_test.yml", cwd=DEPLOY)
    assert result.returncode == 0, ok(result)
    assert "SUCCESS" in result.stdout + result.stderr


def test_every_rule_is_unit_tested() -> None:
    spec = yaml.safe_load((DEPLOY / "rules_test.yml").read_text())
    assert spec["rule_files"] == list(RULE_FILES)
    cases = [t for case in spec["tests"] for t in case.get("alert_rule_test", [])]
    alerts = {r["alert"] for r in rules("alert_rules.yml")}
    assert {t["alertname"] for t in cases if t.get("exp_alerts")} == alerts, "shown firing"
    assert {t["alertname"] for t in cases if not t.get("exp_alerts")} == alerts, "shown quiet"
    exprs = " ".join(t["expr"] for case in spec["tests"] for t in case.get("promql_expr_test", []))
    recorded = {r["record"] for r in rules("recording_rules.yml")}
    assert recorded - set(RECORDED.findall(exprs)) == set(), "every recording rule's value"


def test_rules_follow_the_conventions() -> None:
    for rule in rules("recording_rules.yml"):
        level, metric, operations = rule["record"].split(":")
        assert level == "prefix_serve" and metric and operations, rule["record"]
    for rule in rules("alert_rules.yml"):
        assert rule["alert"].startswith("PrefixServe")
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]


def test_every_metric_the_rules_name_is_exported() -> None:
    """In expressions, series names; in annotations (for the operator) family names too."""
    exported = exported_series()
    named = exported | {name for name, _ in families()}
    recorded = {r["record"] for r in rules("recording_rules.yml")}
    assert "prefix_serve_replica_num_waiting" in exported  # the scan found the collectors
    assert "prefix_serve_tenant_ttft_seconds_bucket" in exported
    unknown = {}
    for rule in all_rules():
        notes = " ".join(rule.get("annotations", {}).values())
        names = set(METRIC.findall(rule["expr"])) - exported
        names |= set(METRIC.findall(notes)) - named
        names |= set(RECORDED.findall(rule["expr"] + " " + notes)) - recorded
        if names:
            unknown[rule.get("record") or rule["alert"]] = sorted(names)
    assert unknown == {}

"""Alert rules: promtool checks and unit tests, the PrometheusRule generated from
them, the runbook they point to, and the metric names they and the Grafana
dashboard use."""
from __future__ import annotations

import importlib.util
import json
import re

import yaml

from .manifests import DEPLOY, KNOWN_METRICS, KUSTOMIZATIONS, find, find_tool, render, run_tool

PROMETHEUS = DEPLOY / "prometheus"
ALERTS = PROMETHEUS / "alerts.yaml"
RUNBOOK = DEPLOY / "RUNBOOK.md"
DASHBOARD = DEPLOY / "grafana" / "kvsentry.json"
REQUIRED_ALERTS = {"KVCacheNaNDetected", "KVCacheNullBlockWritten", "CorruptedRequests",
                   "KVCacheChecksumMismatch", "KVCacheForeignWrite",
                   "KVSentryDown", "HighQueueWait", "KVSentryRankRestarting"}


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r]


def promtool(*args: str) -> None:
    result = run_tool([find_tool("promtool"), *args], cwd=PROMETHEUS)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}\n{result.stderr}"


def test_promtool_check_rules() -> None:
    promtool("check", "rules", ALERTS.name)


def test_promtool_unit_tests() -> None:
    promtool("test", "rules", "alerts_test.yaml")


def test_promtool_check_example_config() -> None:
    promtool("check", "config", "prometheus.yml")


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yaml").read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    for name in {r["alert"] for r in alert_rules()}:
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"{name}: no case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{name}: no case where it stays quiet"


def test_alerts_are_complete() -> None:
    rules = alert_rules()
    assert REQUIRED_ALERTS <= {r["alert"] for r in rules}
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), rule["alert"]


def _github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_runbook_urls_point_at_runbook_sections() -> None:
    anchors = {_github_anchor(line.lstrip("#")) for line in RUNBOOK.read_text().splitlines() if line.startswith("#")}
    for rule in alert_rules():
        path, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert path == "deploy/RUNBOOK.md", rule["alert"]
        assert anchor in anchors, f"{rule['alert']}: no section #{anchor} in RUNBOOK.md"


# ---- one source of truth: PrometheusRule == alerts.yaml ------------------------------

def _load_generator():
    spec = importlib.util.spec_from_file_location("generate_prometheusrule", PROMETHEUS / "generate_prometheusrule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_prometheusrule_is_generated_from_alerts() -> None:
    generator = _load_generator()
    assert generator.OUTPUT.read_text() == generator.render(ALERTS.read_text()), \
        "stale: run python deploy/prometheus/generate_prometheusrule.py"


def test_rendered_prometheusrules_equal_alerts() -> None:
    alerts = yaml.safe_load(ALERTS.read_text())
    rendered = {name: find(render(name), "PrometheusRule") for name in KUSTOMIZATIONS}
    with_rules = {name: rules for name, rules in rendered.items() if rules}
    assert with_rules, "no overlay renders the PrometheusRule"
    for name, rules in with_rules.items():
        assert len(rules) == 1, name
        assert rules[0]["spec"] == alerts, f"{name}: PrometheusRule differs from alerts.yaml"


# ---- metric names ------------------------------------------------------------------------

def metric_names(promql: str) -> set[str]:
    """kvsentry metric families a query reads (histogram series map to their family)."""
    def family(series: str) -> str:
        base = re.sub(r"_(bucket|sum|count)$", "", series)
        return base if base in KNOWN_METRICS else series
    return {family(s) for s in re.findall(r"\bkvsentry_[a-z0-9_]+", promql)}


def test_alerts_use_known_metrics() -> None:
    for rule in alert_rules():
        unknown = metric_names(rule["expr"]) - KNOWN_METRICS
        assert not unknown, f"{rule['alert']}: unknown metrics {unknown}"


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def test_dashboard_is_well_formed() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"]
    assert "datasource" in {v["name"] for v in board["templating"]["list"]}
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert "gridPos" in panel, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]


def test_dashboard_uses_known_metrics_and_shows_them_all() -> None:
    used = set().union(*(metric_names(e) for e in dashboard_exprs()))
    assert not used - KNOWN_METRICS, f"unknown metrics: {used - KNOWN_METRICS}"
    assert not KNOWN_METRICS - used, f"metrics without a panel: {KNOWN_METRICS - used}"

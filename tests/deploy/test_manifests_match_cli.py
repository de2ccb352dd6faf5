"""The deployment files against the real program: every command line in the
manifests and the Dockerfile parses with `kvsentry serve`'s own parser, the HTTP
paths they rely on are routes of the app, and the metrics the alerts and the
dashboard read are exported.

This is the one file of tests/deploy that imports the service; adapt the small
adapters below (`serve_parser`, `parse`, `app_routes`, `exported_metrics`) if its
API moves."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from types import SimpleNamespace
from unittest import mock

import pytest

from .manifests import (BOOLEAN_FLAGS, DEPLOY, KNOWN_METRICS, KUSTOMIZATIONS, dockerfile_entrypoint,
                        dockerfile_exec_form, launches, parse_flags, render)


def serve_parser() -> argparse.ArgumentParser:
    from service.cli import build_parser
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and "serve" in action.choices:
            return action.choices["serve"]
    pytest.fail("service.cli.build_parser() has no `serve` subcommand", pytrace=False)


def serve_options() -> set[str]:
    return {option for action in serve_parser()._actions for option in action.option_strings}


def parse(argv: list[str]) -> argparse.Namespace:
    """Parses a full argv ("serve", ...) as the program would, failing with argparse's message."""
    from service.cli import build_parser
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"kvsentry {' '.join(argv)}\n{err.getvalue()}", pytrace=False)


def app_routes() -> set[str]:
    """Paths of the app's OpenAPI schema. build_app only registers routes and reads
    settings; nothing starts until the lifespan runs."""
    from service.app import build_app
    from service.state import ServeSettings
    stand_in = SimpleNamespace(settings=ServeSettings(("m",), enable_fault_injection=True))
    return set(build_app(stand_in).openapi()["paths"])


def exported_metrics() -> set[str]:
    """Metric names (as PromQL sees them) a fresh server exports, with one idle DP rank."""
    import msgspec
    from prometheus_client.parser import text_string_to_metric_families

    from engine.dp.supervision import SupervisionCounters
    from engine.messages import StepStats
    from service.metrics import Metrics
    idle = StepStats(**{f.name: 0 for f in msgspec.structs.fields(StepStats) if f.required})
    metrics = Metrics("m", lambda: {0: idle})
    metrics.watch_supervision(lambda: SupervisionCounters(ranks=(0,)))  # as service/state.py does
    text = metrics.render().decode()
    return {f.name + "_total" if f.type == "counter" else f.name for f in text_string_to_metric_families(text)}


def all_command_lines() -> dict[str, list[str]]:
    """Every argv the deployment files give kvsentry, by where it comes from."""
    lines = {"Dockerfile ENTRYPOINT + CMD": dockerfile_entrypoint()[1:] + dockerfile_exec_form("CMD")}
    for name in KUSTOMIZATIONS:
        for launch in launches(render(name)):
            lines[f"{name}: {launch.pod_name}"] = launch.argv
    return lines


def test_every_flag_exists_in_the_serve_parser() -> None:
    options = serve_options()
    unknown = {}
    for where, argv in all_command_lines().items():
        assert argv[0] == "serve", f"{where}: runs `kvsentry {argv[0]}`"
        flags = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
        if flags - options:
            unknown[where] = sorted(flags - options)
    assert not unknown, f"flags the CLI does not know: {unknown}"


@pytest.mark.parametrize("where", sorted(all_command_lines()))
def test_command_line_parses(where: str) -> None:
    argv = all_command_lines()[where]
    args = parse(argv)
    assert getattr(args, "command", "serve") == "serve"
    # The other deploy tests read flags with a simple parser; it must agree with the real one.
    actions = {option: action for action in serve_parser()._actions for option in action.option_strings}
    for flag, value in parse_flags(argv[1:]).items():
        action = actions[flag]
        got = getattr(args, action.dest)
        if value is True:
            assert got is True, flag
        else:
            expected = (action.type or str)(value)
            assert (got[0] if action.nargs in ("+", "*") else got) == expected, flag


def test_boolean_flags_of_the_helper_match_the_parser() -> None:
    valueless = {option for action in serve_parser()._actions if action.nargs == 0 and action.option_strings
                 for option in action.option_strings} - {"-h", "--help"}
    assert valueless == BOOLEAN_FLAGS


def test_api_key_is_read_from_the_environment() -> None:
    # The manifests pass the key only as KVSENTRY_API_KEY (from a Secret).
    with mock.patch.dict(os.environ, {"KVSENTRY_API_KEY": "from-env"}):
        args = parse(["serve"])
    assert getattr(args, "api_key", None) == "from-env", \
        "--api-key does not default to $KVSENTRY_API_KEY: the pods would run without a key"


def test_probe_and_scrape_paths_are_app_routes() -> None:
    routes = app_routes()
    used = {"/metrics"}  # ServiceMonitor, prometheus.yml
    for name in KUSTOMIZATIONS:
        for launch in launches(render(name)):
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if "httpGet" in launch.container.get(probe, {}):
                    used.add(launch.container[probe]["httpGet"]["path"])
    assert {"/health", "/ready"} <= used
    assert used <= routes, f"not routes of the app: {used - routes}"


def test_runbook_fault_injection_route_exists() -> None:
    runbook = (DEPLOY / "RUNBOOK.md").read_text()
    used = set(re.findall(r"http://127\.0\.0\.1:8000(/[\w/.-]*)", runbook))
    assert "/debug/faults" in used
    assert used <= app_routes(), f"RUNBOOK.md calls paths the app does not have: {used - app_routes()}"


def test_metrics_of_alerts_and_dashboard_are_exported() -> None:
    # KNOWN_METRICS is what alerts.yaml and the dashboard may use (tests/deploy/test_prometheus.py).
    missing = KNOWN_METRICS - exported_metrics()
    assert not missing, f"alerts/dashboard use metrics the server does not export: {sorted(missing)}"

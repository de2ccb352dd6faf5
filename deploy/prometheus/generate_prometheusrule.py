"""Writes the PrometheusRule of components/monitoring from alerts.yaml.

alerts.yaml is the one source of truth; the PrometheusRule carries the same
groups. Run after editing alerts.yaml (tests/deploy fails until you do):

    python deploy/prometheus/generate_prometheusrule.py          # write
    python deploy/prometheus/generate_prometheusrule.py --check  # exit 1 if stale
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent.parent
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
OUTPUT = DEPLOY / "k8s" / "components" / "monitoring" / "prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/alerts.yaml by
# deploy/prometheus/generate_prometheusrule.py: edit alerts.yaml, then rerun it.
#
# The Prometheus Operator only loads rules whose labels match its ruleSelector;
# kube-prometheus-stack, for one, wants `release: <helm release name>`: add it
# with a kustomize `labels:` entry in your overlay.
"""


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(alerts_text: str) -> str:
    rule_file = yaml.safe_load(alerts_text)
    resource = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvsentry", "labels": {"app.kubernetes.io/name": "kvsentry"}},
        "spec": {"groups": rule_file["groups"]},
    }
    return HEADER + yaml.dump(resource, Dumper=_Dumper, sort_keys=False, width=1000)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether the output is stale")
    args = parser.parse_args()
    wanted = render(ALERTS.read_text())
    current = OUTPUT.read_text() if OUTPUT.exists() else None
    if args.check:
        if current != wanted:
            print(f"{OUTPUT} is stale: run python {Path(__file__).relative_to(DEPLOY.parent)}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())

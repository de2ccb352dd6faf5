"""Shared helpers of tests/deploy: locating tools, rendering the kustomizations,
and turning every kvsentry container in them into the command line it runs."""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = REPO / "Dockerfile"
INSTALL_HINT = "run `bash scripts/install_ci_tools.sh` (installs promtool, kubectl, hadolint)"

# Every kustomization that builds on its own: base and each overlay.
KUSTOMIZATIONS = {"base": K8S / "base"} | {
    p.parent.name: p.parent for p in sorted((K8S / "overlays").glob("*/kustomization.yaml"))}

NAMESPACE = "kvsentry"  # what the overlays set; stands in for the downward API
# `kvsentry serve` flags that take no value (store_true / BooleanOptionalAction).
BOOLEAN_FLAGS = {"--headless", "--enable-fault-injection", "--log-prompts", "--allow-credentials",
                 "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--dummy-batch-random-inputs", "--no-dummy-batch-random-inputs",
                 "--nan-scan-written-blocks", "--no-nan-scan-written-blocks",
                 "--strict-kv-writes", "--no-strict-kv-writes",
                 "--enforce-eager", "--no-enforce-eager",
                 "--cuda-graph-check-null-block", "--no-cuda-graph-check-null-block",
                 # vLLM's switches (service/vllm_flags.py)
                 "--trust-request-chat-template", "--enable-auto-tool-choice", "--disable-log-requests",
                 "--enable-log-requests", "--enable-expert-parallel", "-ep", "--enable-chunked-prefill",
                 "--no-enable-chunked-prefill", "--trust-remote-code", "--disable-log-stats", "--enable-lora"}

# The metric families kvsentry exports (Prometheus names, before _bucket/_sum/_count).
KNOWN_METRICS = {
    "kvsentry_kv_cache_nan_values", "kvsentry_kv_cache_nan_detections_total",
    "kvsentry_null_block_writes_total", "kvsentry_dummy_batches_total",
    "kvsentry_padded_tokens_total", "kvsentry_corrupted_requests_total",
    "kvsentry_kv_cache_heals_total", "kvsentry_kv_cache_scan_seconds",
    "kvsentry_kv_cache_scan_coverage_steps", "kvsentry_kv_cache_checksum_mismatches_total",
    "kvsentry_kv_cache_sealed_blocks", "kvsentry_kv_cache_checksum_coverage_steps",
    "kvsentry_kv_foreign_writes_total", "kvsentry_kv_cache_checksum_seconds",
    "kvsentry_num_requests_running",
    "kvsentry_num_requests_waiting", "kvsentry_kv_cache_usage_perc",
    "kvsentry_prefix_cache_queries_total", "kvsentry_prefix_cache_hits_total",
    "kvsentry_num_preemptions_total", "kvsentry_prompt_tokens_total",
    "kvsentry_generation_tokens_total", "kvsentry_request_success_total",
    "kvsentry_time_to_first_token_seconds", "kvsentry_inter_token_latency_seconds",
    "kvsentry_e2e_request_latency_seconds", "kvsentry_request_queue_time_seconds",
    "kvsentry_http_requests_total", "kvsentry_http_request_duration_seconds",
    "kvsentry_rank_restarts_total", "kvsentry_requests_requeued_total",
    "kvsentry_requests_failed_by_rank_death_total", "kvsentry_live_ranks",
}


def find_tool(name: str) -> str:
    """The tool beside the test interpreter (pip-installed wheels), else on PATH.
    Missing is a failure, never a skip: CI must run these checks."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: {INSTALL_HINT}", pytrace=False)
    return found


def run_tool(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kwargs)


@functools.cache
def render(name: str) -> tuple[dict, ...]:
    """`kubectl kustomize` of one kustomization, parsed; cached per session."""
    result = run_tool([find_tool("kubectl"), "kustomize", str(KUSTOMIZATIONS[name])])
    assert result.returncode == 0, f"kubectl kustomize {name} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def find(docs: tuple[dict, ...], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


# ---- pod templates and the command lines they run ---------------------------------

def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(role, pod template) of a workload; role names the template inside it."""
    kind, spec = doc["kind"], doc.get("spec", {})
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return [("template", spec["template"])]
    if kind == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [(r, lwt[f"{r}Template"]) for r in ("leader", "worker") if f"{r}Template" in lwt]
    return []


@dataclass
class Launch:
    """One pod a workload starts, and what its kvsentry container runs."""
    owner: dict
    role: str
    pod_name: str
    template: dict
    container: dict
    env: dict[str, str]
    argv: list[str]  # after the program name: ["serve", ...]
    flags: dict[str, Any] = field(default_factory=dict)

    @property
    def pod_spec(self) -> dict:
        return self.template["spec"]

    @property
    def headless(self) -> bool:
        return "--headless" in self.flags

    def flag(self, name: str, default: Any = None) -> Any:
        return self.flags.get(name, default)


def dockerfile_exec_form(instruction: str) -> list[str]:
    """The last ENTRYPOINT or CMD of the final stage, which must be in exec (JSON) form."""
    found = [rest for ins, rest in dockerfile_final_stage() if ins == instruction]
    assert found, f"Dockerfile: no {instruction} in the final stage"
    return json.loads(found[-1])


def dockerfile_entrypoint() -> list[str]:
    return dockerfile_exec_form("ENTRYPOINT")


def parse_flags(argv: list[str]) -> dict[str, Any]:
    """--flag value / --flag=value / bare boolean flags -> {flag: value}."""
    flags: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--"):
            if "=" in token:
                key, value = token.split("=", 1)
                flags[key] = value
            elif token in BOOLEAN_FLAGS:
                flags[token] = True
            else:
                assert i + 1 < len(argv), f"{token} has no value in {argv}"
                flags[token] = argv[i + 1]
                i += 1
        i += 1
    return flags


def positionals(argv: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--"):
            i += 1 if ("=" in token or token in BOOLEAN_FLAGS) else 2
            continue
        out.append(token)
        i += 1
    return out


def _pod_env(container: dict, extra: dict[str, str]) -> dict[str, str]:
    env = dict(extra)
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[var["name"]] = NAMESPACE
        elif "secretKeyRef" in var.get("valueFrom", {}):
            env[var["name"]] = "test-secret-value"
    return env


def _run_shell(script: str, env: dict[str, str]) -> list[str]:
    """Runs a container's `sh -c` wrapper with a stub `kvsentry` that records argv."""
    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / "kvsentry"
        stub.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGV_OUT"\n')
        stub.chmod(0o755)
        out = Path(tmp) / "argv"
        full_env = {"PATH": f"{tmp}:/usr/bin:/bin", "ARGV_OUT": str(out), **env}
        result = subprocess.run(["/bin/sh", "-c", script], env=full_env, capture_output=True, text=True, timeout=10)
        assert result.returncode == 0, f"launch script failed ({result.returncode}): {result.stderr}\n{script}"
        assert out.exists(), f"launch script did not exec kvsentry:\n{script}"
        return out.read_text().split("\0")[:-1]


def _argv(container: dict, env: dict[str, str]) -> list[str] | None:
    """What the kvsentry program receives, or None for a container that is not kvsentry."""
    if "kvsentry" not in container.get("image", ""):
        return None
    expand = lambda s: re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), s)  # noqa: E731
    command = [expand(c) for c in container.get("command", [])]
    args = [expand(a) for a in container.get("args", [])]
    if not command:
        entrypoint = dockerfile_entrypoint()
        assert entrypoint[0] == "kvsentry", entrypoint
        return entrypoint[1:] + args
    if command[:2] in (["/bin/sh", "-c"], ["sh", "-c"]):
        return _run_shell(args[0] if command[2:] == [] else command[2], env)
    assert Path(command[0]).name == "kvsentry", f"unexpected command {command}"
    return command[1:] + args


def launches(docs: tuple[dict, ...]) -> list[Launch]:
    """Every kvsentry container of every pod the documents would start."""
    out = []
    for doc in docs:
        name = doc["metadata"]["name"]
        for role, template in pod_templates(doc):
            for pod_name, extra in _pods(doc, role, name):
                for container in template["spec"]["containers"]:
                    env = _pod_env(container, extra)
                    argv = _argv(container, env)
                    if argv is not None:
                        out.append(Launch(doc, role, pod_name, template, container, env, argv, parse_flags(argv)))
    return out


def _pods(doc: dict, role: str, name: str) -> Iterator[tuple[str, dict[str, str]]]:
    """(pod name, environment the platform sets) for each pod of a template."""
    kind, spec = doc["kind"], doc.get("spec", {})
    if kind == "LeaderWorkerSet":
        size = spec["leaderWorkerTemplate"].get("size", 1)
        base = {"LWS_GROUP_SIZE": str(size), "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{NAMESPACE}"}
        indices = [0] if role == "leader" else range(1, size)
        for index in indices:
            pod = f"{name}-0" if index == 0 else f"{name}-0-{index}"
            yield pod, {**base, "LWS_WORKER_INDEX": str(index), "HOSTNAME": pod}
    elif kind == "StatefulSet":
        for ordinal in range(spec.get("replicas", 1)):
            pod = f"{name}-{ordinal}"
            yield pod, {"HOSTNAME": pod}
    else:
        yield f"{name}-xxxxx", {"HOSTNAME": f"{name}-xxxxx"}


# ---- Dockerfile ---------------------------------------------------------------------

def dockerfile_instructions(text: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    text = DOCKERFILE.read_text() if text is None else text
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        instruction, _, rest = full.partition(" ")
        out.append((instruction.upper(), rest.strip()))
    return out


def dockerfile_final_stage(text: str | None = None) -> list[tuple[str, str]]:
    instructions = dockerfile_instructions(text)
    last_from = max(i for i, (ins, _) in enumerate(instructions) if ins == "FROM")
    return instructions[last_from:]


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())

"""Dockerfile: hadolint, plus the rules this project cares most about, checked
directly and against the Kubernetes manifests."""
from __future__ import annotations

import json
import re

from .manifests import (DOCKERFILE, KUSTOMIZATIONS, REPO, dockerfile_final_stage, dockerfile_instructions,
                        find_tool, launches, render, run_tool)

SECRET_NAME = re.compile(r"(?i)(secret|token|passw|credential|api_?key|private_?key|access_?key)")


def build_args() -> dict[str, str]:
    """Defaults of the global ARGs (those before the first FROM)."""
    out = {}
    for instruction, rest in dockerfile_instructions():
        if instruction == "FROM":
            break
        if instruction == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            out[key] = value
    return out


def from_lines(**overrides: str) -> list[tuple[str, str | None]]:
    """(image or stage reference, stage name) of every FROM, global ARGs substituted."""
    args = build_args() | overrides
    out = []
    for instruction, rest in dockerfile_instructions():
        if instruction == "FROM":
            words = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), words[0])
            out.append((image, words[2] if len(words) == 3 and words[1].upper() == "AS" else None))
    return out


def base_images() -> list[str]:
    """External images (FROMs that do not name an earlier stage, nor the empty `scratch`)."""
    stages: set[str] = set()
    images = []
    for image, stage in from_lines():
        if "${" not in image and image not in stages and image != "scratch":
            images.append(image)
        stages.add(stage)
    return images


def final(instruction: str) -> list[str]:
    return [rest for ins, rest in dockerfile_final_stage() if ins == instruction]


def test_hadolint() -> None:
    result = run_tool([find_tool("hadolint"), "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_images_are_pinned() -> None:
    images = base_images()
    assert images
    for image in images:
        name, _, digest = image.partition("@")
        tag = name.rpartition(":")[2] if ":" in name.rsplit("/", 1)[-1] else ""
        assert tag and tag != "latest", f"{image}: no explicit tag"
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest) or re.search(r"\d+\.\d+\.\d+", tag), \
            f"{image}: pin a digest or an exact x.y.z tag"
    assert any(i.startswith("python:3.11.") and "-slim-bookworm@sha256:" in i for i in images), images


def test_cpu_is_default_and_cuda_is_a_build_arg() -> None:
    assert build_args().get("DEVICE") == "cpu"
    for device in ("cpu", "cuda"):
        lines = from_lines(DEVICE=device)
        stages = {stage for _, stage in lines}
        picked = [image for image, _ in lines if image in stages]
        assert picked == [f"build-{device}", f"run-{device}"], f"DEVICE={device}: builds on {picked}"
    text = DOCKERFILE.read_text()
    assert "download.pytorch.org/whl/cpu" in text and "download.pytorch.org/whl/${TORCH_CUDA}" in text


def test_runs_as_numeric_non_root_user_matching_the_pods() -> None:
    users = final("USER")
    assert users, "no USER in the final stage"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: use a numeric non-root uid (runAsNonRoot checks it)"
    for name in KUSTOMIZATIONS:
        for launch in launches(render(name)):
            assert launch.pod_spec["securityContext"]["runAsUser"] == int(uid), f"{name}: {launch.pod_name}"


def test_no_secrets_in_env_or_args() -> None:
    for instruction, rest in dockerfile_instructions():
        if instruction not in ("ENV", "ARG"):
            continue
        for key in re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)(?==|\s|$)", rest):
            assert not SECRET_NAME.search(key), f"{instruction} {key}: pass secrets at run time, not in the image"


def test_entrypoint_is_kvsentry_serve_in_exec_form() -> None:
    assert json.loads(final("ENTRYPOINT")[-1]) == ["kvsentry", "serve"]
    cmd = json.loads(final("CMD")[-1])
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"


def test_expose_matches_cmd_healthcheck_and_manifests() -> None:
    (exposed,) = final("EXPOSE")
    port = int(exposed.split("/")[0])
    cmd = json.loads(final("CMD")[-1])
    assert int(cmd[cmd.index("--port") + 1]) == port
    (healthcheck,) = final("HEALTHCHECK")
    assert f"127.0.0.1:{port}/health" in healthcheck
    for name in KUSTOMIZATIONS:
        for launch in launches(render(name)):
            if not launch.headless:
                ports = {p["name"]: p["containerPort"] for p in launch.container["ports"]}
                assert ports["http"] == port, f"{name}: {launch.pod_name}"


def test_cache_dir_is_set_and_writable_in_the_pods() -> None:
    env = " ".join(final("ENV"))
    match = re.search(r"KVSENTRY_CACHE_DIR=(\S+)", env)
    assert match, "ENV KVSENTRY_CACHE_DIR missing"
    cache_dir = match.group(1)
    uid = final("USER")[-1].split(":")[0]
    assert f"install -d -o {uid} -g {uid} -m 0750 {cache_dir}" in " ".join(final("RUN")), "cache dir not owned by USER"
    for name in KUSTOMIZATIONS:
        for launch in launches(render(name)):
            assert launch.env.get("KVSENTRY_CACHE_DIR") == cache_dir
            mounts = {m["mountPath"] for m in launch.container["volumeMounts"]}
            assert cache_dir in mounts, f"{name}: {launch.pod_name} has no volume at {cache_dir}"


def test_dockerignore_keeps_the_context_small_and_clean() -> None:
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "**/__pycache__", "tests", "deploy"} <= ignored

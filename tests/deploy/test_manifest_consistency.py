"""Rules that hold across the rendered manifests: probes, ports, shutdown timing,
security context, volumes, secrets, GPUs, and the DP rank layout of multi-pod
engines (launch scripts are run with a stub `kvsentry` to see their real argv).

Each check returns a list of problems, so the tests below can also show that a
broken manifest is caught."""
from __future__ import annotations

import copy

import pytest

from .manifests import KUSTOMIZATIONS, Launch, find, launches, pod_templates, positionals, render

CACHE_DIR = "/var/cache/kvsentry"
DEFAULT_RPC_PORT = 29550
MIN_STARTUP_BUDGET_S = 300  # loading weights: liveness must not kill a pod that is still loading
# Flags of the HTTP front end, or that differ per pod by design; all others
# configure the engine and must agree across the pods of one DP group.
PER_POD_FLAGS = {"--host", "--port", "--served-model-name", "--api-key", "--max-queued-requests", "--headless",
                 "--max-request-body-bytes", "--shutdown-timeout", "--health-stall-timeout", "--log-level",
                 "--log-prompts", "--enable-fault-injection", "--threads", "--data-parallel-start-rank",
                 "--data-parallel-size-local"}


def _port(launch: Launch, port: int | str) -> int | None:
    if isinstance(port, int):
        return port
    return {p["name"]: p["containerPort"] for p in launch.container.get("ports", [])}.get(port)


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def check_probes(launch: Launch) -> list[str]:
    c = launch.container
    probes = {k: c.get(k) for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    if launch.headless:
        return [f"{k} on a headless pod, which serves no HTTP" for k, p in probes.items() if p and "httpGet" in p]
    problems = []
    want = {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
    port = int(launch.flag("--port", 0))
    for kind, path in want.items():
        probe = probes[kind]
        if not probe or "httpGet" not in probe:
            problems.append(f"{kind}: missing httpGet probe")
            continue
        if probe["httpGet"]["path"] != path:
            problems.append(f"{kind}: path {probe['httpGet']['path']}, want {path}")
        if _port(launch, probe["httpGet"]["port"]) != port:
            problems.append(f"{kind}: port {probe['httpGet']['port']} is not --port {port}")
    startup = probes["startupProbe"] or {}
    budget = startup.get("failureThreshold", 3) * startup.get("periodSeconds", 10)
    if budget < MIN_STARTUP_BUDGET_S:
        problems.append(f"startupProbe allows {budget} s to load, want >= {MIN_STARTUP_BUDGET_S}")
    return problems


def _prestop_seconds(container: dict) -> int:
    prestop = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in prestop:
        return int(prestop["sleep"]["seconds"])
    command = prestop.get("exec", {}).get("command", [])
    return int(command[1]) if command[:1] == ["sleep"] else 0


def check_shutdown(launch: Launch) -> list[str]:
    prestop = _prestop_seconds(launch.container)
    grace = launch.pod_spec.get("terminationGracePeriodSeconds", 30)
    if launch.headless:  # stops at SIGTERM; its drain timing is checked per DP group
        return [] if grace >= prestop else [f"terminationGracePeriodSeconds {grace} < preStop {prestop}"]
    timeout = launch.flag("--shutdown-timeout")
    if timeout is None:
        return ["no --shutdown-timeout"]
    problems = []
    if prestop == 0:
        problems.append("no preStop sleep: requests still routed here after SIGTERM would fail")
    if grace < prestop + float(timeout):
        problems.append(f"terminationGracePeriodSeconds {grace} < preStop {prestop} + --shutdown-timeout {timeout}")
    return problems


def check_security(launch: Launch) -> list[str]:
    pod, ctr = launch.pod_spec.get("securityContext", {}), launch.container.get("securityContext", {})
    problems = []
    if not ctr.get("runAsNonRoot", pod.get("runAsNonRoot")):
        problems.append("runAsNonRoot is not true")
    if ctr.get("allowPrivilegeEscalation") is not False:
        problems.append("allowPrivilegeEscalation is not false")
    if ctr.get("readOnlyRootFilesystem") is not True:
        problems.append("readOnlyRootFilesystem is not true")
    if "ALL" not in ctr.get("capabilities", {}).get("drop", []):
        problems.append("capabilities not dropped")
    if launch.pod_spec.get("automountServiceAccountToken") is not False:
        problems.append("service account token mounted")
    if launch.pod_spec.get("enableServiceLinks") is not False:
        problems.append("enableServiceLinks: the Service 'kvsentry' would inject KVSENTRY_* variables")
    return problems


def check_volumes(launch: Launch, docs: tuple[dict, ...]) -> list[str]:
    volumes = {v["name"]: v for v in launch.pod_spec.get("volumes", [])}
    mounts = {m["mountPath"]: m for m in launch.container.get("volumeMounts", [])}
    problems = []
    for path in ("/tmp", CACHE_DIR, "/dev/shm"):
        volume = volumes.get(mounts.get(path, {}).get("name"), {})
        if "emptyDir" not in volume:
            problems.append(f"{path}: not an emptyDir (the root filesystem is read-only)")
        elif path == "/dev/shm" and volume["emptyDir"].get("medium") != "Memory":
            problems.append("/dev/shm: emptyDir without medium: Memory")
    model_dirs = positionals(launch.argv[1:])
    if model_dirs:
        mount = mounts.get(model_dirs[0])
        claim = volumes.get(mount["name"], {}).get("persistentVolumeClaim") if mount else None
        if not (mount and mount.get("readOnly") and claim and claim.get("readOnly")):
            problems.append(f"{model_dirs[0]}: not a read-only PVC mount")
        elif not find(docs, "PersistentVolumeClaim", claim["claimName"]):
            problems.append(f"PVC {claim['claimName']} is not part of the manifests")
    return problems


def check_secrets(launch: Launch) -> list[str]:
    if "--api-key" in launch.flags:
        return ["--api-key on the command line: use KVSENTRY_API_KEY from a Secret"]
    env = {e["name"]: e for e in launch.container.get("env", [])}
    if launch.headless:
        return []
    ref = env.get("KVSENTRY_API_KEY", {}).get("valueFrom", {}).get("secretKeyRef")
    return [] if ref and ref.get("name") and ref.get("key") else ["KVSENTRY_API_KEY is not from a Secret"]


def _cpu_quantity(value: str | int) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def check_device(launch: Launch) -> list[str]:
    device = launch.flag("--device")
    if device not in ("cpu", "cuda"):
        return [f"--device {device}: say cpu or cuda explicitly"]
    limits = launch.container.get("resources", {}).get("limits", {})
    gpus = int(limits.get("nvidia.com/gpu", 0))
    local = int(launch.flag("--data-parallel-size-local") or launch.flag("--data-parallel-size") or 1)
    tag = launch.container["image"].rpartition(":")[2] if ":" in launch.container["image"] else None
    problems = []
    if device == "cuda":
        if gpus != local:
            problems.append(f"{gpus} GPUs for {local} local DP ranks (one GPU per rank)")
        if not any(t.get("key") == "nvidia.com/gpu" for t in launch.pod_spec.get("tolerations", [])):
            problems.append("no toleration for nvidia.com/gpu")
    else:
        if gpus:
            problems.append("GPUs requested for --device cpu")
        # Each rank defaults to node cores / local ranks threads, oversubscribing the pod.
        cpus = launch.container.get("resources", {}).get("requests", {}).get("cpu")
        threads = launch.flag("--threads")
        if threads is None or cpus is None or int(threads) * local > _cpu_quantity(cpus):
            problems.append(f"--device cpu: set --threads so threads x {local} ranks <= CPU request {cpus}")
    if tag is not None and not tag.endswith("-cuda" if device == "cuda" else "-cpu"):
        problems.append(f"image tag {tag} does not match --device {device}")
    return problems


POD_CHECKS = [check_probes, check_shutdown, check_security, check_secrets, check_device]


def check_dp_groups(group: list[Launch]) -> list[str]:
    """The pods of one engine cover DP ranks 0..N-1 once, with one front end at rank 0."""
    problems = []
    sizes = {int(launch.flag("--data-parallel-size", 1)) for launch in group}
    if len(sizes) != 1:
        return [f"pods disagree on --data-parallel-size: {sizes}"]
    (size,) = sizes
    ranks: list[int] = []
    for launch in group:
        start = int(launch.flag("--data-parallel-start-rank", 0))
        local = int(launch.flag("--data-parallel-size-local", size))
        ranks += range(start, start + local)
    if sorted(ranks) != list(range(size)):
        problems.append(f"ranks {sorted(ranks)} do not cover 0..{size - 1} once")
    front_ends = [launch for launch in group if not launch.headless]
    if len(front_ends) != 1 or int(front_ends[0].flag("--data-parallel-start-rank", 0)) != 0:
        problems.append("want exactly one front end, holding rank 0")
    engine_flags = {tuple(sorted((k, v) for k, v in launch.flags.items() if k not in PER_POD_FLAGS))
                    for launch in group}
    engine_args = {tuple(positionals(launch.argv[1:])) for launch in group}
    if len(engine_flags) != 1 or len(engine_args) != 1:
        problems.append("engine flags or MODEL_DIR differ between the pods of one DP group")
    if len(front_ends) == 1:
        # All pods of a group get SIGTERM together; the front end's drain needs every rank.
        front = front_ends[0]
        drain = _prestop_seconds(front.container) + float(front.flag("--shutdown-timeout", 0))
        for worker in (launch for launch in group if launch.headless):
            if _prestop_seconds(worker.container) < drain:
                problems.append(f"{worker.pod_name}: preStop shorter than the front end's drain ({drain:g} s)")
    return problems


def dp_groups(all_launches: list[Launch]) -> list[list[Launch]]:
    groups: dict[str, list[Launch]] = {}
    for launch in all_launches:
        key = launch.flag("--data-parallel-address") or f"local:{launch.pod_name}"
        groups.setdefault(key, []).append(launch)
    return list(groups.values())


def check_leader_address(group: list[Launch], docs: tuple[dict, ...]) -> list[str]:
    """Workers reach the front end's pod by DNS on a port it declares."""
    address = group[0].flag("--data-parallel-address")
    if address is None:
        return [] if len(group) == 1 else ["multi-pod DP group without --data-parallel-address"]
    (front_end,) = [launch for launch in group if not launch.headless]
    pod, subdomain = address.split(".")[:2]
    problems = []
    if pod != front_end.pod_name:
        problems.append(f"--data-parallel-address {address} does not name the front-end pod {front_end.pod_name}")
    owner = front_end.owner
    if owner["kind"] == "StatefulSet":
        services = find(docs, "Service", subdomain)
        headless = services and services[0]["spec"].get("clusterIP") == "None"
        if owner["spec"].get("serviceName") != subdomain or not headless:
            problems.append(f"{subdomain}: not the headless governing Service of {owner['metadata']['name']}")
    elif owner["kind"] == "LeaderWorkerSet" and subdomain != owner["metadata"]["name"]:
        problems.append(f"{subdomain}: LWS pods live under the subdomain {owner['metadata']['name']}")
    # The front end listens on --data-parallel-rpc-port and the two ports after it.
    rpc_port = int(front_end.flag("--data-parallel-rpc-port", DEFAULT_RPC_PORT))
    declared = {p["containerPort"] for p in front_end.container.get("ports", [])}
    if not {rpc_port, rpc_port + 1, rpc_port + 2} <= declared:
        problems.append(f"ports {rpc_port}..{rpc_port + 2} (--data-parallel-rpc-port) not all declared "
                        "by the front end")
    return problems


def check_routing(docs: tuple[dict, ...], all_launches: list[Launch]) -> list[str]:
    problems = []
    (service,) = find(docs, "Service", "kvsentry")
    selector = service["spec"]["selector"]
    selected = [launch for launch in all_launches if _matches(selector, launch.template["metadata"]["labels"])]
    if {id(x) for x in selected} != {id(x) for x in all_launches if not x.headless}:
        problems.append("Service kvsentry must select exactly the front-end pods")
    for launch in selected:
        for port in service["spec"]["ports"]:
            if _port(launch, port["targetPort"]) != int(launch.flag("--port", -1)):
                problems.append(f"Service targetPort {port['targetPort']} is not --port of {launch.pod_name}")
    for pdb in find(docs, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        if not all(_matches(selector, x.template["metadata"]["labels"]) for x in all_launches):
            problems.append(f"PDB {pdb['metadata']['name']} does not cover every kvsentry pod")
    for monitor in find(docs, "ServiceMonitor"):
        if not _matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"]):
            problems.append("ServiceMonitor does not select Service kvsentry")
        port_names = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            if endpoint.get("port") not in port_names or endpoint.get("path") != "/metrics":
                problems.append(f"ServiceMonitor endpoint {endpoint} is not Service port + /metrics")
        others = [s for s in find(docs, "Service") if s is not service
                  and _matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
        if others:
            problems.append("ServiceMonitor also selects other Services: pods would be scraped twice")
    for hpa in find(docs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        if not find(docs, ref["kind"], ref["name"]):
            problems.append(f"HPA targets missing {ref['kind']}/{ref['name']}")
    return problems


def check_no_committed_secrets(docs: tuple[dict, ...]) -> list[str]:
    return [f"Secret {s['metadata']['name']} carries data in the manifests"
            for s in find(docs, "Secret") if s.get("data") or s.get("stringData")]


def all_problems(docs: tuple[dict, ...]) -> list[str]:
    all_launches = launches(docs)
    problems = [] if all_launches else ["no kvsentry container"]
    for launch in all_launches:
        for check in POD_CHECKS:
            problems += [f"{launch.pod_name}: {p}" for p in check(launch)]
        problems += [f"{launch.pod_name}: {p}" for p in check_volumes(launch, docs)]
    for group in dp_groups(all_launches):
        problems += check_dp_groups(group) + check_leader_address(group, docs)
    return problems + check_routing(docs, all_launches) + check_no_committed_secrets(docs)


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_manifests_are_consistent(name: str) -> None:
    problems = all_problems(render(name))
    assert not problems, "\n".join(problems)


def test_multinode_overlays_really_span_pods() -> None:
    for name in ("multinode", "multinode-statefulset"):
        groups = dp_groups(launches(render(name)))
        assert len(groups) == 1 and len(groups[0]) >= 2, name
        assert any(launch.headless for launch in groups[0])
        # The shell wrappers computed distinct start ranks from the pod identity.
        starts = sorted(int(launch.flag("--data-parallel-start-rank")) for launch in groups[0])
        local = int(groups[0][0].flag("--data-parallel-size-local"))
        assert starts == [i * local for i in range(len(groups[0]))]


# ---- the checks catch breakage ------------------------------------------------------------

def _container(doc: dict, role: str = "template") -> dict:
    return dict(pod_templates(doc))[role]["spec"]["containers"][0]


def _edit_script(container: dict, old: str, new: str) -> None:
    assert old in container["args"][0], f"breakage no longer applies: {old!r} not in the launch script"
    container["args"] = [container["args"][0].replace(old, new)]


def short_grace(d: dict) -> None:
    dict(pod_templates(d))["template"]["spec"]["terminationGracePeriodSeconds"] = 60


def readiness_on_health(d: dict) -> None:
    _container(d)["readinessProbe"]["httpGet"]["path"] = "/health"


def writable_root(d: dict) -> None:
    _container(d)["securityContext"]["readOnlyRootFilesystem"] = False


def overlapping_worker_ranks(d: dict) -> None:
    _edit_script(_container(d, "worker"), "LWS_WORKER_INDEX * DP_LOCAL", "(LWS_WORKER_INDEX - 1) * DP_LOCAL")


def leader_engine_flag_differs(d: dict) -> None:
    _edit_script(_container(d), "--max-num-seqs 256", "--max-num-seqs 128")


def one_gpu_for_two_ranks(d: dict) -> None:
    _container(d)["resources"]["limits"]["nvidia.com/gpu"] = "1"


def worker_stops_before_the_drain(d: dict) -> None:
    _container(d, "worker")["lifecycle"]["preStop"]["exec"]["command"] = ["sleep", "5"]


def rpc_port_undeclared(d: dict) -> None:
    _container(d, "leader")["ports"].pop()


def wrong_target_port(d: dict) -> None:
    d["spec"]["ports"][0]["targetPort"] = 8080


def unbounded_cpu_threads(d: dict) -> None:
    args = _container(d)["args"]
    del args[args.index("--threads"):args.index("--threads") + 2]


BREAKAGES = [  # (kustomization, kind of the first object to break, breakage, expected problem)
    ("gpu", "Deployment", short_grace, "terminationGracePeriodSeconds"),
    ("cpu", "Deployment", readiness_on_health, "readinessProbe: path"),
    ("cpu", "Deployment", writable_root, "readOnlyRootFilesystem"),
    ("multinode", "LeaderWorkerSet", overlapping_worker_ranks, "do not cover"),
    ("multinode-statefulset", "StatefulSet", leader_engine_flag_differs, "engine flags"),
    ("gpu", "Deployment", one_gpu_for_two_ranks, "GPUs for"),
    ("multinode", "LeaderWorkerSet", rpc_port_undeclared, "--data-parallel-rpc-port"),
    ("multinode", "LeaderWorkerSet", worker_stops_before_the_drain, "front end's drain"),
    ("cpu", "Service", wrong_target_port, "targetPort"),
    ("cpu", "Deployment", unbounded_cpu_threads, "--threads"),
]


@pytest.mark.parametrize("name,kind,breakage,expected", BREAKAGES, ids=[b[2].__name__ for b in BREAKAGES])
def test_checks_catch(name: str, kind: str, breakage, expected: str) -> None:
    docs = copy.deepcopy(render(name))
    breakage(next(d for d in docs if d["kind"] == kind))
    problems = all_problems(docs)
    assert any(expected in p for p in problems), problems

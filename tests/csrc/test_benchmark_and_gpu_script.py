"""benchmarks/ and scripts/gpu_check.sh on a machine without a GPU, run for real: the bandwidth
benchmark's CPU paths; the verdict every engine-vs-peer benchmark ends with (judge.py, the
float32 scorer against transformers), serve.py end to end with a kvsentry stand-in for the peer;
the JSON each benchmark writes; and gpu_check.sh's rehearsal of every step on the CPU."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "benchmarks"
BENCH = BENCH_DIR / "kv_write_bandwidth.py"
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def load_benchmark():
    spec = importlib.util.spec_from_file_location("kv_write_bandwidth", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@no_cuda
def test_benchmark_without_cuda_says_so_and_exits_0():
    proc = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is not available" in proc.stdout


@no_cuda
def test_benchmark_cpu_reference_is_labelled(capsys):
    assert load_benchmark().main(["--cpu-reference", "--tokens", "1", "64", "--iters", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch reference only, no kernel measured" in out
    assert "reshape_and_cache_flash" in out and "concat_and_cache_mla" in out


def test_benchmark_kernel_path_runs(kvsentry_ops, tmp_path, capsys):
    """The GPU code path, driven through the ops' CPU implementation: every op, fp8, the JSON."""
    out_json = tmp_path / "bw.json"
    code = load_benchmark().main(["--smoke-cpu", "--fp8", "--tokens", "1", "40", "--iters", "1", "--repeats", "1",
                                  "--target-from", "1", "--json", str(out_json)])
    assert code == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["op"], r["tokens"]) for r in rows] == [
        (op, n) for op in ("reshape_and_cache_flash", "concat_and_cache_mla",
                           "reshape_and_cache_flash fp8", "concat_and_cache_mla fp8") for n in (1, 40)]
    assert all(r["kernel_gbs"] > 0 and r["copy_gbs"] > 0 and r["reference_gbs"] > 0 for r in rows)
    assert "target: kernel >= 80% of d2d copy bandwidth at >= 1 tokens" in capsys.readouterr().out


@pytest.fixture
def bench_modules(monkeypatch):
    """Import benchmark scripts as they run: with benchmarks/ first on sys.path."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    names = ("common", "servers", "serve", "offline_vllm", "judge", "results", "near_tie_threshold")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield lambda name: importlib.import_module(name)
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def bench_llama(tmp_path_factory) -> Path:
    from service.demo.checkpoint import write_preset
    return write_preset(tmp_path_factory.mktemp("bench-llama"), "bench-llama")


def test_require_identical_passes_equal_outputs_and_fails_on_any_difference(bench_modules):
    common = bench_modules("common")
    names = ("ours", "peer")
    assert common.require_identical("tokens", [[1, 2], [3]], [[1, 2], [3]], names) == \
        "tokens: outputs identical for 2/2 (ours vs peer)"
    with pytest.raises(SystemExit) as failed:
        common.require_identical("tokens", [[1, 2], [3], [4]], [[1, 9], [3], None], names, ["a", "b", "c"])
    message = str(failed.value.code)  # a str code: printed to stderr, exit status 1
    assert message.startswith("FAIL tokens: outputs differ for 2/3 (ours vs peer)")
    assert "a: first difference at item 1 of 2/2: ours [2] vs peer [9]" in message
    assert "c: ours ok, peer no output" in message
    with pytest.raises(SystemExit):
        common.require_identical("tokens", [[1]], [[1], [2]], names)


# -- judge.py: the verdict every engine-vs-peer benchmark ends with --------------------------------------
def test_judge_float32_counts_identical_outputs_and_fails_on_any_difference(bench_modules):
    judge = bench_modules("judge")
    prompts = [[5], [6], [7]]
    verdict = judge.judge("ids", "float32", [[1, 2], [3], [4]], [[1, 2], [3], [4]], prompts, ("a", "b"))
    assert verdict.passed and (verdict.identical, verdict.near_tie, verdict.not_near_tie) == (3, 0, 0)
    assert verdict.threshold is None  # float32 has no near-ties to allow

    def refuse(queries):
        raise AssertionError("float32 divergences are failures, not scored")

    verdict = judge.judge("ids", "float32", [[1, 2], [3], [4]], [[1, 9], [3], None], prompts, ("a", "b"),
                          ["r0", "r1", "r2"], score=refuse)
    assert not verdict.passed
    assert (verdict.identical, verdict.not_near_tie, verdict.missing) == (1, 1, ["r2"])
    summary = verdict.summary()
    assert summary.startswith("FAIL ids (float32, a vs b): 1/3 identical, 1 differ")
    assert "r0: first difference at token 1: 2 vs 9" in summary
    data = verdict.as_json()
    assert data["passed"] is False and data["divergences"][0]["at"] == 1 and data["missing"] == ["r2"]


def test_judge_bfloat16_scores_each_first_divergence_after_its_common_prefix(bench_modules):
    judge = bench_modules("judge")
    seen = []
    logprobs = {7: -1.0, 8: -1.0 - (judge.NEAR_TIE_LOGPROB - 0.01), 9: -1.0 - judge.NEAR_TIE_LOGPROB}

    def score(queries):
        seen.extend(queries)
        return [logprobs[token] for _, token in queries]

    prompts = [[100, 101], [102], [103], [104]]
    ours = [[1, 7, 3], [2, 2], [7, 7], [5]]
    theirs = [[1, 8, 4], [2, 2], [7, 9], [5, 6]]
    verdict = judge.judge("ids", "bfloat16", ours, theirs, prompts, ("a", "b"), score=score)
    # The scorer saw prompt + common prefix, once with each side's token.
    assert seen == [([100, 101, 1], 7), ([100, 101, 1], 8), ([103, 7], 7), ([103, 7], 9)]
    assert (verdict.identical, verdict.near_tie, verdict.not_near_tie) == (1, 1, 2)
    # A gap of exactly the threshold with a's token float32's better one is b's rounding; the output
    # that ended early fails the run.
    assert not verdict.passed and verdict.peer_rounding == 1
    gaps = {d.label: d.gap for d in verdict.divergences}
    assert gaps["request 0"] == pytest.approx(judge.NEAR_TIE_LOGPROB - 0.01)
    assert gaps["request 2"] == pytest.approx(judge.NEAR_TIE_LOGPROB) and gaps["request 3"] is None
    near = judge.judge("ids", "bfloat16", ours[:2], theirs[:2], prompts[:2], ("a", "b"), score=score)
    assert near.passed and near.as_json()["near_tie_threshold_logprob"] == judge.NEAR_TIE_LOGPROB
    unscored = judge.judge("ids", "bfloat16", ours[:2], theirs[:2], prompts[:2], ("a", "b"))
    assert not unscored.passed  # no float32 scorer: no divergence can be shown to be a near-tie


def test_judge_bfloat16_fails_only_where_our_token_is_float32s_worse_one(bench_modules):
    """Past the near-tie bound, a divergence whose kvsentry token float32 ranks higher is the peer's
    rounding (counted, listed, not failed); one whose kvsentry token float32 ranks lower fails."""
    judge = bench_modules("judge")
    t = judge.NEAR_TIE_LOGPROB
    logprobs = {1: -1.0, 2: -1.0 - t - 0.3, 3: -1.0 - t / 2}

    def score(queries):
        return [logprobs[token] for _, token in queries]

    prompts = [[100], [101], [102]]
    ours, theirs = [[1], [5, 3], [5]], [[2], [5, 1], [5]]  # ours better; ours a near-tie worse; same
    verdict = judge.judge("ids", "bfloat16", ours, theirs, prompts, ("a", "b"), score=score)
    assert verdict.passed
    assert (verdict.identical, verdict.near_tie, verdict.not_near_tie, verdict.peer_rounding) == (1, 1, 1, 1)
    assert verdict.as_json()["peer_rounding"] == 1
    summary = verdict.summary()
    assert "1 of them b's rounding" in summary and "NOT a near-tie (b's rounding)" in summary
    flipped = judge.judge("ids", "bfloat16", theirs, ours, prompts, ("a", "b"), score=score)
    assert not flipped.passed and (flipped.not_near_tie, flipped.peer_rounding) == (1, 0)
    assert "rounding)" not in flipped.summary().split("\n", 1)[1]


def test_float32_scorer_is_kvsentry_float32_logprob_of_each_candidate(bench_modules, bench_llama):
    """The scorer's logprobs against transformers' own float32 log-softmax after the same context."""
    transformers = pytest.importorskip("transformers")
    judge = bench_modules("judge")
    contexts = [[5, 17, 300, 4000], [9] * 20 + [123, 456]]
    queries = [(contexts[0], 11), (contexts[0], 31999), (contexts[1], 7)]
    threads = torch.get_num_threads()
    scorer = judge.Float32Scorer(str(bench_llama), max_model_len=256)
    # The exact path: a GGUF's default on a VNNI CPU multiplies int8 activations, in float32 too.
    assert (scorer.llm.config.model.dtype, scorer.llm.config.quantized_activations) == (torch.float32, "none")
    try:
        got = scorer(queries)
    finally:
        scorer.close()
        torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(bench_llama, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [torch.log_softmax(model(torch.tensor([c])).logits[0, -1].float(), -1)[t].item() for c, t in queries]
    assert got == pytest.approx(want, abs=1e-4)


def test_near_tie_threshold_measures_the_shift_of_the_float32_top2_gap(bench_modules):
    ntt = bench_modules("near_tie_threshold")
    reference = [[None, {1: -0.5, 2: -1.5, 3: -4.0}, {4: -0.1, 5: -3.0}]]
    other = [[None, {1: -0.9, 2: -0.7, 3: -4.0}, {4: -0.2, 6: -2.0}]]
    moved, flips, unseen = ntt.shifts(reference, other, 1)
    assert moved == pytest.approx([(-0.9 + 0.7) - (-0.5 + 1.5)])  # the gap 1.0 became -0.2: a flip
    assert flips == pytest.approx([1.0]) and unseen == 1        # token 5 is not in the other's top
    assert ntt.quantiles([0.1, -0.4, 0.2])["max"] == 0.4


# -- results.py: where a result goes and what names it ---------------------------------------------
def test_results_are_named_by_date_machine_and_commit(bench_modules, tmp_path):
    results = bench_modules("results")
    stamp = results.provenance()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", stamp["date"]) and stamp["cores"] == os.cpu_count()
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?|unknown", stamp["commit"])
    assert re.fullmatch(r"[a-z0-9-]+-\d+c", stamp["machine"])
    path = results.result_path("serve-bfloat16", stamp)
    assert path.parent == ROOT / "benchmarks" / "results"
    assert path.name == f"serve-bfloat16_{stamp['date']}_{stamp['machine']}_{stamp['commit']}.json"
    written = results.write_result("x", {"rows": [1]}, tmp_path / "x.json")
    assert json.loads(written.read_text()) == {"provenance": json.loads(written.read_text())["provenance"],
                                               "rows": [1]}


# -- serve.py ---------------------------------------------------------------------------------------------
def test_serve_levels_have_fresh_prompts_that_every_server_shares(bench_modules):
    serve = bench_modules("serve")
    args = serve.parse_args(["--url", "http://x", "--concurrency", "1,4", "--mixed-range", "16", "32"])
    levels = serve.levels(args)
    assert [(lv.workload.name, lv.concurrency) for lv in levels] == [
        ("fixed-128", 1), ("fixed-128", 4), ("mixed-16..32", 1), ("mixed-16..32", 4)]
    prompts = [lv.prompts((5, 500)) for lv in levels]
    assert prompts == [lv.prompts((5, 500)) for lv in serve.levels(args)]  # the same bytes for every server
    firsts = [tuple(p[0]) for p in prompts]
    assert len(set(firsts)) == len(firsts)  # no level repeats another's prompt
    assert (args.kvsentry_threads, args.vllm_threads) == (1, 1)  # one compute thread each by default
    assert args.dtype == "float32" and serve.parse_args(["--url", "x", "--dtype", "bfloat16"]).dtype == "bfloat16"
    # float32's identical-ids gate runs kvsentry's exact path; bf16 its default; a flag given wins (it comes last).
    assert args.kvsentry_args == "--quantized-activations none"
    assert serve.parse_args(["--url", "x", "--dtype", "bfloat16"]).kvsentry_args == ""
    given = serve.parse_args(["--url", "x", "--kvsentry-args", "--quantized-activations int8"]).kvsentry_args
    assert given.split()[-2:] == ["--quantized-activations", "int8"]


def test_serve_judges_token_ids_and_a_server_without_them_fails(bench_modules):
    serve = bench_modules("serve")
    args = serve.parse_args(["--url", "x", "--dtype", "bfloat16", "--concurrency", "1", "--min-requests", "2",
                             "--mixed-range", "4", "4", "--input-len", "4", "--token-range", "5", "9"])
    count = sum(level.requests for level in serve.levels(args))
    prompts = [p for level in serve.levels(args) for p in level.prompts((5, 9))]

    def run(outputs):
        return [serve.RunResult("s", "w", 1, count, 1.0, 0, outputs=[serve.RequestResult(0.1, 0.01, 2, "", ids)
                                                                      for ids in outputs])]

    ours = [[1, 3]] * count
    scored = []

    def score(queries):  # token 4 nearly ties token 3; token 8 is far below
        scored.extend(queries)
        return [{3: -1.0, 4: -1.2, 8: -6.0}[token] for _, token in queries]

    verdict = serve.compare_outputs(run(ours), run([[1, 4]] + ours[1:]), args, score)
    assert verdict.passed and (verdict.identical, verdict.near_tie) == (count - 1, 1)
    assert scored == [(prompts[0] + [1], 3), (prompts[0] + [1], 4)]
    assert not serve.compare_outputs(run([[1, 8]] + ours[1:]), run(ours), args, score).passed  # ours far below
    peer = serve.compare_outputs(run(ours), run([[1, 8]] + ours[1:]), args, score)  # the peer's far below
    assert peer.passed and peer.peer_rounding == 1
    no_ids = serve.compare_outputs(run(ours), run([None] * count), args, score)
    assert not no_ids.passed and len(no_ids.missing) == count  # text alone is never compared


def kvsentry_stand_in(serve, monkeypatch, peer_dtype: str | None = None) -> list[list[str]]:
    """Start kvsentry where serve.py starts vLLM (the peer venv is absent in CI), and record every
    server command line: the benchmark's own flow, servers, gate and JSON, end to end."""
    servers = importlib.import_module("servers")
    commands = []
    real_popen = subprocess.Popen

    def popen(argv, *args, **kwargs):
        commands.append(list(argv))
        return real_popen(argv, *args, **kwargs)

    class StandIn(servers.KvsentryServer):
        def __init__(self, model, args):
            super().__init__(model, args if peer_dtype is None else argparse.Namespace(**{**vars(args),
                                                                                           "dtype": peer_dtype}))

    monkeypatch.setattr(servers.subprocess, "Popen", popen)
    monkeypatch.setattr(serve, "VllmServer", StandIn)
    return commands


@pytest.mark.slow
def test_serve_end_to_end_fails_its_gate_and_still_writes_the_verdict(bench_modules, bench_llama, tmp_path,
                                                                       monkeypatch):
    """Both servers started by serve.py with prefix caching off, float32 judged; the peer serves
    in bfloat16, so it computes something else: the gate fails (exit 1) after the comparison,
    and the JSON is written with the failed verdict and each divergence. (The passing side of
    the gate, and the near-tie judgement, are the unit tests above.)"""
    serve = bench_modules("serve")
    commands = kvsentry_stand_in(serve, monkeypatch, "bfloat16")
    out = tmp_path / "serve.json"
    code = serve.main(["--start-kvsentry", str(bench_llama), "--start-vllm", str(bench_llama), "--concurrency", "2",
                       "--min-requests", "2", "--requests-per-client", "1", "--input-len", "8",
                       "--mixed-range", "4", "12", "--output-len", "6", "--json", str(out)])
    result = json.loads(out.read_text())
    verdict = result["verdict"]
    assert result["provenance"]["commit"] and result["errors"] == 0 and len(result["rows"]) == 4
    assert [r["workload"] for r in result["ratios"]] == ["fixed-8", "mixed-4..12"]
    started = [argv for argv in commands if "serve" in argv]
    assert len(started) == 4 and all("--no-enable-prefix-caching" in argv for argv in started)
    assert sum("bfloat16" in argv for argv in started) == 2  # the peer's two starts
    assert verdict["requests"] == 4 and verdict["dtype"] == "float32"
    assert code == 1 and not verdict["passed"] and verdict["not_near_tie"] >= 1
    assert verdict["identical"] + verdict["not_near_tie"] == 4 and verdict["divergences"]


# -- the other benchmarks' results ------------------------------------------------------------------
def _run_benchmark(tmp_path, script: str, *args: str) -> dict:
    """Run benchmarks/`script` with `args` as a user would; it must exit 0. Returns its JSON."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(BENCH_DIR / script), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
def test_offline_benchmark_times_fresh_prompts_and_writes_its_verdict(tmp_path):
    result = _run_benchmark(tmp_path, "offline_throughput.py", "--threads", "1", "--requests", "2",
                            "--prompt-len", "16", "--new-tokens", "3", "--repeats", "2")
    assert result["prefix_cache_hit_tokens"] == 0
    assert result["verdict"]["passed"] and result["verdict"]["identical"] == 4
    assert result["verdict"]["engines"] == ["kvsentry", "transformers"]


def test_sentinel_overhead_writes_every_mode_and_the_token_check(tmp_path):
    result = _run_benchmark(tmp_path, "sentinel_overhead.py", "--requests", "2", "--prompt-len", "8",
                            "--new-tokens", "2", "--rounds", "1", "--kv-cache-memory", "64MiB")
    assert [row["mode"] for row in result["rows"]] == ["off", "null-block", "rolling", "full"]
    assert all(row["tok_s"] > 0 for row in result["rows"])
    assert result["verdict"]["passed"] and set(result["verdict"]["tokens_vs_off"]) == {"null-block", "rolling",
                                                                                        "full"}


def test_offline_vllm_worker_generates_and_main_asks_for_the_peer(bench_modules, tmp_path, monkeypatch):
    """benchmarks/offline_vllm.py: its kvsentry worker (vLLM's needs the peer venv, absent in CI)
    warms up, times one generate of the prompts and returns every token; without the peer's venv
    the benchmark stops before loading anything and says how to install it."""
    from service.demo.checkpoint import write_preset
    offline = bench_modules("offline_vllm")
    write_preset(tmp_path / "m", "bench-llama")
    threads = torch.get_num_threads()
    try:
        out = offline.worker({"engine": "kvsentry", "model": str(tmp_path / "m"), "dtype": "float32", "threads": 1,
                              "prompts": [[5, 6, 7], [8, 9, 10, 11]], "warm": [[12, 13]], "new_tokens": 3})
    finally:
        torch.set_num_threads(threads)
    assert out["seconds"] > 0 and [len(t) for t in out["tokens"]] == [3, 3]
    monkeypatch.setattr(bench_modules("servers"), "VLLM_DIR", tmp_path / "no-peer")
    monkeypatch.setattr(sys, "argv", ["offline_vllm.py", "--model", str(tmp_path / "m")])
    with pytest.raises(SystemExit, match="vllm-cpu.sh install"):
        offline.main()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK), "scripts/gpu_check.sh must be executable"


@no_cuda
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_without_a_gpu_checks_nothing_and_says_so(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Nothing checked" in proc.stdout


def write_probe_wheel(directory: Path) -> Path:
    """A minimal pure-Python wheel (the format pip installs), standing in for a carried one."""
    import zipfile
    files = {
        "kvs_probe/__init__.py": "CARRIED = True\n",
        "kvs_probe-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: kvs_probe\nVersion: 0.1\n",
        "kvs_probe-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: kvsentry-tests\nRoot-Is-Purelib: true\n"
                                         "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "kvs_probe-0.1.dist-info/RECORD,,\n"
    path = directory / "kvs_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in {**files, "kvs_probe-0.1.dist-info/RECORD": record}.items():
            wheel.writestr(name, text)
    return path


@no_cuda
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_installs_carried_wheels_into_a_private_site(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    write_probe_wheel(wheels)
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "KVSENTRY_WHEELS": str(wheels), "KVSENTRY_WHEEL_SITE": str(site)}
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"carried wheels installed into {site}: kvs_probe-0.1-py3-none-any.whl" in proc.stdout
    assert (site / "kvs_probe" / "__init__.py").is_file()
    assert "python modules: all of" in proc.stdout and "Nothing checked" in proc.stdout


@no_cuda
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_names_a_missing_module_before_building(tmp_path):
    # A package on PYTHONPATH whose import fails stands in for one the GPU machine lacks.
    shadow = tmp_path / "shadow" / "msgspec"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not on this machine')\n")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "KVSENTRY_WHEELS": str(tmp_path / "no-wheels"), "PYTHONPATH": str(tmp_path / "shadow")}
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "missing python modules: msgspec. Nothing checked." in proc.stdout
    assert "scripts/gpu_wheels.sh msgspec" in proc.stdout
    assert not (tmp_path / "out" / "build.log").exists()


@no_cuda
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_rehearsal_runs_every_step_on_the_cpu(tmp_path):
    """scripts/gpu_check.sh --rehearse-on-cpu: every step in order through the same runner and
    summary, each step's CPU counterpart for real -- the op library, the GPU tests collected, the
    CUDA graphs program (graphs' forward eagerly over the same buffers, the null block checked
    after every dummy batch), the bandwidth benchmark's kernel path, the DP=2 placement program
    on CPU ranks -- so a GPU run only adds the device."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "KVSENTRY_WHEELS": str(tmp_path / "no-wheels"),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(SCRIPT), "--rehearse-on-cpu"], capture_output=True, text=True, timeout=900, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    steps = ["build", "tests", "graphs", "bandwidth", "placement"]
    headers = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("=== ")]
    assert headers == ["environment", *steps, "summary"]
    summary = proc.stdout[proc.stdout.index("=== summary"):]
    for step in steps:
        assert re.search(rf"^  {step} +PASS ", summary, re.M), summary
    assert re.search(r"tests: +\d+ tests collected", summary)
    graphs = (out / "graphs.log").read_text()
    assert "greedy tokens, cpu graphs: identical to cpu eager" in graphs
    assert "24 dummy batches through the graphs, null block checked after each: null block zero" in graphs
    assert "PASS: CUDA graphs check on cpu" in graphs
    assert "PASS: DP=2 placement check" in (out / "placement.log").read_text()
    rows = json.loads((out / "bandwidth.json").read_text())["rows"]
    assert {r["op"] for r in rows} >= {"reshape_and_cache_flash", "concat_and_cache_mla fp8"}
    assert "REHEARSAL on the CPU: every step ran" in summary

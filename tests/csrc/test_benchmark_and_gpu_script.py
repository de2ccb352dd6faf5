"""benchmarks/ and scripts/gpu_check.sh on a machine without a GPU: the bandwidth benchmark's
CPU paths, and the check every engine-vs-peer benchmark ends with (outputs that must be equal
are, or the run exits non-zero)."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
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
    names = ("common", "servers", "serve", "offline_vllm")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield lambda name: importlib.import_module(name)
    for name in names:
        sys.modules.pop(name, None)


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


def test_bfloat16_outputs_may_diverge_only_at_near_ties_and_only_so_often(bench_modules):
    common = bench_modules("common")
    names = ("ours", "peer")
    ours, theirs = [[1, 2, 3], [4, 5], [6], [7]], [[1, 2, 9], [4, 5], [6], [7]]
    gaps = {(0, 2): 0.25}
    verdict = common.require_equal_up_to_near_ties("tokens", ours, theirs, names, gap=lambda i, at: gaps[i, at],
                                                   max_share=0.25)
    assert verdict.startswith("tokens: 1/4 diverge (ours vs peer;")
    assert "request 0: first difference at token 2, float32 logit gap 0.250" in verdict
    gaps[0, 2] = common.NEAR_TIE_GAP  # one side chose a token the float32 model ranks clearly lower
    with pytest.raises(SystemExit, match="not a near-tie"):
        common.require_equal_up_to_near_ties("tokens", ours, theirs, names, gap=lambda i, at: gaps[i, at])
    with pytest.raises(SystemExit, match="FAIL tokens: 2/4 diverge"):  # too many, ties or not
        common.require_equal_up_to_near_ties("tokens", ["ab", "cd", "e", "f"], ["ax", "cy", "e", "f"], names,
                                             max_share=0.25)
    with pytest.raises(SystemExit, match="no output"):
        common.require_equal_up_to_near_ties("tokens", [[1]], [None], names)


def test_serve_compares_token_ids_or_decoded_text(bench_modules, tmp_path):
    serve = bench_modules("serve")
    done = lambda text, ids: serve.RequestResult(0.1, 0.01, 2, text, ids)  # noqa: E731
    what, ours, theirs = serve.comparable([done("ab", [1, 2])], [done("xab", [1, 2])], str(tmp_path))
    assert (what, ours, theirs) == ("greedy token ids", [[1, 2]], [[1, 2]])

    class Tokenizer:  # stands in for the checkpoint's: ids 1, 2 -> "a", "b"; 3 -> a lone byte
        def decode(self, ids, skip_special_tokens):
            return "".join({1: "a", 2: "b", 3: "\ufffd"}[i] for i in ids)

    import transformers
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: Tokenizer())
        what, ours, theirs = serve.comparable([done("ab", None), done("ab", None), None],
                                              [done("garbage", [1, 2, 3]), done("", [2, 1]), done("a", [1])], "m")
    assert what == "greedy completion text"
    assert ours == ["ab", "ab", None] and theirs == ["ab", "ba", "a"]


def test_serve_judges_bfloat16_divergences_by_float32_logits(bench_modules):
    """Where both servers send token ids, a bfloat16 divergence is judged by a float32 model's logits."""
    serve = bench_modules("serve")
    args = serve.parse_args(["--url", "x", "--dtype", "bfloat16", "--concurrency", "1", "--min-requests", "2",
                             "--mixed-range", "4", "4", "--input-len", "4", "--token-range", "5", "9"])
    count = sum(level.requests for level in serve.levels(args))
    logits = torch.zeros(10)
    logits[3], logits[4] = 5.0, 4.5  # tokens 3 and 4 nearly tied, token 8 far below

    def reference(ids):
        return type("Output", (), {"logits": logits.expand(1, ids.shape[1], 10)})()

    def run(outputs):
        return [serve.RunResult("s", "w", 1, count, 1.0, 0, outputs=[serve.RequestResult(0.1, 0.01, 2, "", ids)
                                                                      for ids in outputs])]

    ours = [[1, 3]] * count
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(serve, "load_transformers", lambda path, dtype: reference)
        verdict = serve.compare_outputs(run(ours), run([[1, 4]] + ours[1:]), "m", args)
        assert f"1/{count} diverge" in verdict and "first difference at token 1, float32 logit gap 0.500" in verdict
        with pytest.raises(SystemExit, match="not a near-tie"):
            serve.compare_outputs(run(ours), run([[1, 8]] + ours[1:]), "m", args)


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


@pytest.mark.slow
def test_offline_benchmark_times_fresh_prompts_and_checks_tokens():
    proc = subprocess.run([sys.executable, str(BENCH_DIR / "offline_throughput.py"), "--threads", "1",
                           "--requests", "2", "--prompt-len", "16", "--new-tokens", "3", "--repeats", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "prefix-cache hits in the timed runs: 0 tokens" in proc.stdout
    assert "greedy tokens: outputs identical for 4/4 (kvsentry vs transformers)" in proc.stdout


def test_offline_vllm_worker_generates_and_main_asks_for_the_peer(bench_modules, tmp_path, monkeypatch):
    """benchmarks/offline_vllm.py: its kvsentry worker (vLLM's needs the peer venv, absent in CI)
    warms up, times one generate of the prompts and returns every token; without the peer's venv
    the benchmark stops before loading anything and says how to install it."""
    import torch

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


def heredoc_program(marker: str) -> str:
    """A program gpu_check.sh writes from its heredoc `marker` and runs."""
    text = SCRIPT.read_text()
    start = text.index(f"<<'{marker}'\n") + len(f"<<'{marker}'\n")
    return text[start:text.index(f"\n{marker}\n", start)]


def dp2_placement_program() -> str:
    """The DP=2 placement check gpu_check.sh runs with 2+ GPUs."""
    return heredoc_program("DP2_EOF")


def test_gpu_check_runs_placement_only_with_two_gpus_and_one_gpu_is_no_failure():
    text = SCRIPT.read_text()
    assert 'if [ "${GPUS:-0}" -ge 2 ]; then' in text
    assert 'cat > "$OUT_DIR/dp2_placement.py" <<\'DP2_EOF\'' in text
    assert '"$PY" "$OUT_DIR/dp2_placement.py" cuda' in text
    assert '"placement SKIPPED (1 GPU)"' in text and "for step in build tests graphs bandwidth placement" in text


@no_cuda
def test_gpu_check_dp2_placement_program_runs_on_cpu(tmp_path):
    """The same program with "cpu": DP=2 CPU ranks vs the DP=1 CPU engine, so a GPU run only
    adds the device: rank l on cuda:l, NCCL, and the memory each rank took on its own GPU."""
    program = tmp_path / "dp2_placement.py"
    program.write_text(dp2_placement_program())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(program), "cpu"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: DP=2 placement check" in proc.stdout


def test_gpu_check_runs_the_cuda_graphs_program_after_the_tests():
    text = SCRIPT.read_text()
    assert 'cat > "$OUT_DIR/cuda_graphs_check.py" <<\'GRAPHS_EOF\'' in text
    assert '"$PY" "$OUT_DIR/cuda_graphs_check.py" cuda' in text
    assert text.index("run_step tests") < text.index("run_step graphs") < text.index("run_step bandwidth")
    assert 'STATUS[graphs]="SKIPPED (no build)"' in text


@no_cuda
def test_gpu_check_cuda_graphs_program_runs_on_cpu(tmp_path):
    """The CUDA graphs program with "cpu" (fewer dummy batches and decode steps): the graphs'
    fixed-shape forward run eagerly over the same buffers against the CPU engine, the dummy loop
    with the null-block check, and the decode-rate lines, so a GPU run only adds the graphs."""
    program = tmp_path / "cuda_graphs_check.py"
    program.write_text(heredoc_program("GRAPHS_EOF"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(program), "cpu", "24", "3"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "greedy tokens, cpu graphs: identical to cpu eager" in proc.stdout
    assert "24 dummy batches through the graphs, null block checked after each: null block zero" in proc.stdout
    assert all(f"decode tokens/s at batch {batch:>2} on cpu: graphs" in proc.stdout for batch in (1, 8, 32))
    assert "PASS: CUDA graphs check on cpu" in proc.stdout

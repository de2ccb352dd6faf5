#!/usr/bin/env bash
# The GPU check of csrc/, prepared for one run on a lent GPU (an H200: about 4-6 minutes):
#   1. JIT-build the CUDA ops (engine/ops/cuda_ops.py) into a fresh extension directory
#   2. pytest -m gpu tests/gpu  (kernels vs the torch reference bit for bit, graphs, compile,
#      and the whole engine on CUDA vs CPU, tiny Llama and tiny DeepSeek-V3)
#   3. CUDA graphs, DP=1 (engine/worker/cuda_graphs.py): greedy tokens of the engine on CUDA eager,
#      CUDA graphs and CPU identical (float32 tiny Llama); 1000 dummy batches replayed through the
#      graphs with the null block checked after each; decode tokens/s, graphs vs eager, at batch
#      1/8/32 (about a minute)
#   4. benchmarks/kv_write_bandwidth.py --fp8 (target: >= 80% of a d2d copy at >= 4k tokens)
#   5. with 2+ visible GPUs: DP=2 placement (engine/placement.py): rank l on cuda:l, NCCL for
#      the lockstep all-reduce and the EP all-gather / reduce-scatter, tokens equal to the CPU
#      engine's (about a minute). With one GPU it is skipped: the DP=1 CUDA engine run with the
#      null-block check is in step 2 (tests/gpu/test_engine_gpu.py).
#   6. a summary; exit 0 only when every step passed (a skipped placement step is not a failure)
# Before any of it: wheels carried in .whl/ (scripts/gpu_wheels.sh; the lent machine reaches no
# package registry) go into a private site directory, and every module the check imports must
# load, or it stops at once, naming what is missing, before spending device time on a build.
#
# Logs, junit XML and the bandwidth JSON go to $OUT when set (the device tool brings that
# folder back), else to build/gpu_check. Run from anywhere:
#   scripts/gpu_check.sh
#   PYTHON=/opt/venv/bin/python scripts/gpu_check.sh    # a torch built with CUDA
# Through the device tool: scripts/gpu_wheels.sh here, then run "scripts/gpu_check.sh" with
# carry [".whl"] and timeout_s 420 (a rerun must fit in the 15 minutes); 600 with 2+ GPUs.
#
#   scripts/gpu_check.sh --rehearse-on-cpu
# runs the same steps, in the same order, through the same step runner and summary, with each
# step's CPU counterpart: the CPU op library, the GPU tests collected (not run), the CUDA graphs
# and DP=2 programs with "cpu", the bandwidth benchmark's kernel path on the CPU ops. It proves
# the script and its programs work before device time is spent; it says nothing about a GPU.
# tests/csrc/test_benchmark_and_gpu_script.py runs it.
set -uo pipefail
REHEARSE=0
[ "${1:-}" = --rehearse-on-cpu ] && REHEARSE=1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
OUT_DIR=${OUT:-build/gpu_check}
mkdir -p "$OUT_DIR"
T0=$(date +%s)
declare -A STATUS SECONDS_TAKEN

say() { printf '\n=== %s (t+%ss)\n' "$*" "$(( $(date +%s) - T0 ))"; }

# A python whose torch sees a GPU: $PYTHON, the repo's venv, then what is on PATH. Without one,
# the first that has torch at all (so the module check below still reports), else nothing.
sees_gpu() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

pick_python() {
  local candidate fallback=""
  for candidate in "${PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    "$candidate" -c 'import torch' 2>/dev/null || continue
    [ -n "$fallback" ] || fallback=$candidate
    if sees_gpu "$candidate"; then
      echo "$candidate"
      return 0
    fi
  done
  [ -n "$fallback" ] && echo "$fallback"
}

# What the build, tests/gpu and the benchmark import besides torch (engine/ and tests/ alike).
REQUIRED_MODULES="msgspec safetensors tokenizers numpy jinja2 pytest ninja"

# run_step NAME TIMEOUT_S LOG -- command...: records PASS/FAIL/TIMEOUT and the time taken.
run_step() {
  local name=$1 limit=$2 log=$3 start rc
  shift 4
  say "$name"
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$log"
  rc=${PIPESTATUS[0]}
  SECONDS_TAKEN[$name]=$(( $(date +%s) - start ))
  case $rc in
    0) STATUS[$name]=PASS ;;
    124|137) STATUS[$name]="TIMEOUT (${limit}s)" ;;
    *) STATUS[$name]="FAIL (exit $rc)" ;;
  esac
  return "$rc"
}

say "environment"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
else
  echo "nvidia-smi: not on PATH"
fi
command -v nvcc >/dev/null && nvcc --version | tail -n 2
command -v ninja >/dev/null && echo "ninja $(ninja --version)" || echo "ninja: not on PATH (pip install ninja; torch's JIT build needs it)"
PY=$(pick_python)
if [ -z "$PY" ]; then
  echo "No python with torch (set PYTHON=...). Nothing checked."
  exit 2
fi
WHEELS=${KVSENTRY_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  # Into a directory of their own, behind the image's packages: a carried wheel only fills a gap.
  SITE=${KVSENTRY_WHEEL_SITE:-/tmp/kvsentry-site}
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl; then
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE"
    echo "carried wheels installed into $SITE: $(cd "$WHEELS" && ls -1 -- *.whl | tr '\n' ' ')"
  else
    echo "carried wheels in $WHEELS did not install (built for another python?)."
  fi
fi
missing=$("$PY" - $REQUIRED_MODULES <<'EOF'
import importlib, sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        missing.append(name)
print(" ".join(missing))
EOF
)
if [ -n "$missing" ]; then
  echo "missing python modules: $missing. Nothing checked. Fetch wheels on a machine with a registry"
  echo "(scripts/gpu_wheels.sh $missing) and carry .whl with the run."
  exit 2
fi
echo "python modules: all of $REQUIRED_MODULES load"
DEVICE=cuda
if [ "$REHEARSE" = 1 ]; then
  DEVICE=cpu
  echo "REHEARSAL on the CPU: each step runs its CPU counterpart; nothing here is a GPU result."
elif ! sees_gpu "$PY"; then
  echo "No python with a CUDA-enabled torch that sees a GPU (set PYTHON=...). Nothing checked."
  exit 2
fi
[ "$DEVICE" = cuda ] && "$PY" - <<'EOF'
import sys, torch
print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}, "
      f"{torch.cuda.device_count()} device(s)")
EOF

export KVSENTRY_EXTENSION_DIR=${KVSENTRY_EXTENSION_DIR:-$PWD/build/torch_extensions}
[ "$DEVICE" = cuda ] && export KVSENTRY_REQUIRE_CUDA_OPS=1  # a failed build is an error, never a silent fallback
export KVSENTRY_DEBUG_OPS=1                  # the test build, which tests/gpu loads too: one compile
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ "$DEVICE" = cuda ] && [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
  export TORCH_CUDA_ARCH_LIST
fi
echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-} MAX_JOBS=$MAX_JOBS KVSENTRY_EXTENSION_DIR=$KVSENTRY_EXTENSION_DIR"

if [ "$DEVICE" = cpu ]; then
  run_step build 300 build.log -- "$PY" -c \
    'from engine.ops import cpu_ops; assert cpu_ops.available(); print("CPU op library loaded")'
else
run_step build 300 build.log -- "$PY" - <<'EOF'
import time, torch
t = time.time()
from engine.ops import cuda_ops, registry
path = registry.build(with_cuda=True, verbose=True)
assert registry.op("built_with_cuda")(), "the loaded library is the CPU-only build"
assert cuda_ops.available()
print(f"built {path} in {time.time() - t:.1f}s")
EOF
fi

if [ "${STATUS[build]}" = PASS ]; then
  PYTEST_ARGS=(-m gpu tests/gpu -q -rA -p no:cacheprovider --junitxml="$OUT_DIR/gpu-tests.xml")
  "$PY" -c 'import pytest_timeout' 2>/dev/null && PYTEST_ARGS+=(--timeout=180)
  [ "$DEVICE" = cpu ] && PYTEST_ARGS+=(--collect-only)
  run_step tests 270 tests.log -- "$PY" -m pytest "${PYTEST_ARGS[@]}"
  # A file like the DP=2 program below; tests/csrc/test_benchmark_and_gpu_script.py runs it with "cpu".
  cat > "$OUT_DIR/cuda_graphs_check.py" <<'GRAPHS_EOF'
"""CUDA graphs check (DP=1): greedy tokens of the engine on CUDA eager, on CUDA graphs and on the
CPU identical (a float32 tiny Llama); >= 1000 dummy batches replayed through the graphs with the
null block checked bitwise zero after every one and the cache bitwise unchanged; decode tokens/s,
graphs vs eager, at batch 1, 8 and 32. With "cpu" instead of "cuda" the same program runs the
graphs' fixed-shape forward eagerly over the same persistent buffers (no graph is captured on a
CPU): tests/csrc/test_benchmark_and_gpu_script.py runs it that way on any machine."""
import sys
import tempfile
import time

import torch

from engine.config import EngineConfig
from engine.engine_core.engine_core import EngineCore
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import DecodeGraphs, NullBlockDirtied
from service.demo.checkpoint import write_preset

PROMPTS = [list(range(5, 17)), [7, 8, 9], list(range(20, 61)), [3], list(range(100, 119))]
ENGINE_ARGS = dict(max_model_len=256, kv_cache_memory="64MiB", max_num_seqs=32, dtype="float32")  # identity is float32's
DUMMY_SIZES = (1, 3, 8, 13, 32, 5, 24, 2)  # every size pads to a captured one; 13 after 32 leaves none stale
BATCHES = (1, 8, 32)


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def make_core(path: str, device: str, graphs: bool, **kwargs) -> EngineCore:
    core = EngineCore(EngineConfig.create(path, device=device, enforce_eager=not graphs, **ENGINE_ARGS, **kwargs))
    runner = core.runner
    if graphs and device == "cpu":  # what the runner does on a GPU, minus the graphs themselves
        runner.graphs = DecodeGraphs(core.config, runner.model, runner.kv_storage, runner.kv_caches,
                                     runner.null_block_writes, runner.write_guard)
        with torch.inference_mode():
            runner.graphs.capture()
    if graphs != (runner.graphs is not None):
        raise SystemExit(f"FAIL: decode graphs {'missing' if graphs else 'present'} on {device}")
    return core


def greedy(core: EngineCore, max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):  # ragged lengths, all finishing together: decode batches of 5
        core.add_request(EngineRequest(f"g{i}", prompt, params))
    tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(len(PROMPTS))}
    while core.has_unfinished:
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values())


def dummy_replays(core: EngineCore, count: int) -> list[str]:
    """Replay `count` dummy batches after real traffic; the problems found (none: passed)."""
    greedy(core, 4)  # real K/V in the cache and real rows in the buffers first
    runner = core.runner
    before = runner.kv_storage.clone()
    replays, problems = runner.graphs.replays, []
    try:
        for i in range(count):
            core.run_dummy(DUMMY_SIZES[i % len(DUMMY_SIZES)])  # each checks the null block (debug option)
    except NullBlockDirtied as error:
        problems.append(str(error))
    if runner.graphs.replays - replays != count:
        problems.append(f"{runner.graphs.replays - replays} of {count} dummy batches went through the graphs")
    if not torch.equal(before.view(torch.uint8), runner.kv_storage.view(torch.uint8)):
        problems.append("dummy batches changed the KV cache")
    if runner.graphs.null_block_dirty_layers() or int(runner.null_block_writes.item()):
        problems.append("the null block was written")
    return problems


def decode_rate(core: EngineCore, device: str, batch: int, steps: int) -> float:
    """Decode tokens/s of `batch` requests over `steps` timed decode steps (prefill untimed)."""
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        core.add_request(EngineRequest(f"b{batch}-{i}", list(range(5 + i, 13 + i)), params))
    core.step()  # prefill: every prompt in one step
    core.step()  # a first decode step, untimed
    sync(device)
    start, count = time.perf_counter(), 0
    while core.has_unfinished:
        core.step()
        count += 1
    sync(device)
    return batch * count / (time.perf_counter() - start)


def main(device: str, dummies: int, steps: int) -> int:
    start = time.time()
    if device != "cpu":  # float32 on both sides: no TF32 in the GPU's matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    path = tempfile.mkdtemp(prefix="kvsentry-graphs-")
    write_preset(path, "tiny-llama", init_scale=0.3)
    ok = True
    graphs = make_core(path, device, graphs=True, cuda_graph_check_null_block=True, dummy_batch_random_inputs=True)
    eager = make_core(path, device, graphs=False)
    print(f"decode graph sizes on {device}: {graphs.config.cuda_graph_sizes} "
          f"({'captured CUDA graphs' if graphs.runner.graphs.graphs else 'fixed-shape forward run eagerly'})")
    results = {"cpu eager": greedy(eager if device == "cpu" else make_core(path, "cpu", graphs=False))}
    if device != "cpu":
        results[f"{device} eager"] = greedy(eager)
    results[f"{device} graphs"] = greedy(graphs)
    reference = results["cpu eager"]
    for name, tokens in results.items():
        same = tokens == reference
        ok &= same
        print(f"greedy tokens, {name}: {'identical to cpu eager' if same else 'DIFFER from cpu eager'}")
        if not same:
            print(f"  {tokens}\n  {reference}")
    problems = dummy_replays(graphs, dummies)
    ok &= not problems
    print(f"{dummies} dummy batches through the graphs, null block checked after each: "
          + ("; ".join(problems) if problems else "null block zero, cache bitwise unchanged"))
    for batch in BATCHES:
        fast, slow = decode_rate(graphs, device, batch, steps), decode_rate(eager, device, batch, steps)
        print(f"decode tokens/s at batch {batch:>2} on {device}: graphs {fast:9.1f}, eager {slow:9.1f} "
              f"({fast / slow:.2f}x)")
    print(f"{'PASS' if ok else 'FAIL'}: CUDA graphs check on {device} in {time.time() - start:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda", int(sys.argv[2]) if len(sys.argv) > 2 else 1000,
                  int(sys.argv[3]) if len(sys.argv) > 3 else 32))
GRAPHS_EOF
  GRAPHS_ARGS=(cuda) BANDWIDTH_ARGS=()
  # The rehearsal: fewer dummy batches and decode steps; the kernel path on the CPU ops, no target.
  [ "$DEVICE" = cpu ] && GRAPHS_ARGS=(cpu 24 3) BANDWIDTH_ARGS=(--smoke-cpu --tokens 1 40 --iters 1 --repeats 1
                                                                 --target 0 --target-from 1)
  run_step graphs 180 graphs.log -- env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "$OUT_DIR/cuda_graphs_check.py" "${GRAPHS_ARGS[@]}"
  run_step bandwidth 150 bandwidth.log -- "$PY" benchmarks/kv_write_bandwidth.py --fp8 \
    --json "$OUT_DIR/bandwidth.json" "${BANDWIDTH_ARGS[@]}"
  GPUS=2  # the rehearsal: DP=2 CPU ranks
  [ "$DEVICE" = cuda ] && GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  if [ "${GPUS:-0}" -ge 2 ]; then
    # A file, not stdin: the ranks are spawned, and spawn re-imports the main module.
    # tests/csrc/test_benchmark_and_gpu_script.py runs this program with "cpu" on any machine.
    cat > "$OUT_DIR/dp2_placement.py" <<'DP2_EOF'
"""DP=2 placement check: each rank on its own GPU (NCCL for the lockstep all-reduce and the EP
all-gather / reduce-scatter), greedy tokens equal to the CPU engine's (DP=1), and each rank's
KV cache allocated on its own GPU (cuda:0 and cuda:1). Run as a file: the ranks are spawned."""
import subprocess
import sys
import tempfile
import time

from engine import LLM, SamplingParams
from service.demo.checkpoint import write_preset
from tests.engine.dp_helpers import free_port_block

PROMPTS = [list(range(5, 17)), [7, 8, 9], list(range(20, 61)), [3]]
FREE = ("import torch; print(' '.join(str(torch.cuda.mem_get_info(i)[0]) "
        "for i in range(torch.cuda.device_count())))")


def free_bytes() -> list[int]:
    """Free memory per visible GPU, asked by a process of its own (this one never touches CUDA)."""
    out = subprocess.run([sys.executable, "-c", FREE], capture_output=True, text=True, check=True).stdout
    return [int(x) for x in out.split()]


def greedy(path: str, device: str, dp: int) -> tuple[list[list[int]], list[int], dict]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    on_gpu = device != "cpu"
    before = free_bytes() if on_gpu else []
    llm = LLM(model=path, device=device, data_parallel_size=dp, kv_cache_memory="256MiB", max_model_len=256,
              data_parallel_rpc_port=free_port_block(3))
    try:
        taken = [b - a for b, a in zip(before, free_bytes())] if on_gpu else []
        outs = llm.generate(PROMPTS, params, rank_of=[0, 1, 0, 1] if dp > 1 else None)
        state = getattr(llm.engine, "state", None)
        ops = state.op_implementations if state is not None else {}
    finally:
        llm.close()
    return [list(o.outputs[0].token_ids) for o in outs], taken, ops


def main(device: str) -> int:
    start = time.time()
    path = tempfile.mkdtemp(prefix="kvsentry-dp2-")
    write_preset(path, "tiny-mixtral", init_scale=0.3)
    reference, _, _ = greedy(path, "cpu", 1)
    tokens, taken, ops = greedy(path, device, 2)
    print(f"DP=2 on {device}: each rank's op implementations {ops}")
    ok = True
    if device != "cpu":
        mib = [round(b / 2**20) for b in taken]
        print(f"GPU memory taken while the two ranks were up, per visible device: {mib} MiB")
        if len(mib) < 2 or min(mib[:2]) < 200:  # each rank's 256 MiB KV cache on its own GPU
            print("FAIL: the two ranks did not each allocate on their own GPU (cuda:0 and cuda:1)")
            ok = False
    if tokens != reference:
        print(f"FAIL: DP=2 {device} greedy tokens differ from the CPU engine's:\n  {tokens}\n  {reference}")
        ok = False
    print(f"{'PASS' if ok else 'FAIL'}: DP=2 placement check in {time.time() - start:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
DP2_EOF
    run_step placement 240 placement.log -- env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
      "$PY" "$OUT_DIR/dp2_placement.py" "$DEVICE"
  else
    STATUS[placement]="SKIPPED (${GPUS:-?} GPU)"
  fi
else
  STATUS[tests]="SKIPPED (no build)"
  STATUS[graphs]="SKIPPED (no build)"
  STATUS[bandwidth]="SKIPPED (no build)"
  STATUS[placement]="SKIPPED (no build)"
fi

say "summary"
overall=0
for step in build tests graphs bandwidth placement; do
  printf '  %-10s %-22s %ss\n' "$step" "${STATUS[$step]}" "${SECONDS_TAKEN[$step]:--}"
  case "$step ${STATUS[$step]}" in "placement SKIPPED (1 GPU)"|"$step PASS") ;; *) overall=1 ;; esac
done
if [ -f "$OUT_DIR/tests.log" ]; then
  line=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|tests? collected)\b.* in [0-9.]+s' "$OUT_DIR/tests.log" \
         | tail -n 1)
  echo "  tests:     ${line:-no pytest summary line}"
  wanted=" passed"
  [ "$DEVICE" = cpu ] && wanted=" collected"  # the rehearsal collects the GPU tests, it cannot run them
  case $line in *"$wanted"*) ;; *) overall=1; echo "  tests:     nothing${wanted}: on a GPU machine that is a failure" ;; esac
  grep -E '^(FAILED|ERROR) ' "$OUT_DIR/tests.log" | head -n 20 | sed 's/^/    /'
fi
if [ -f "$OUT_DIR/graphs.log" ]; then
  grep -E '^(greedy tokens|decode tokens/s|[0-9]+ dummy batches)' "$OUT_DIR/graphs.log" | sed 's/^/  graphs:    /'
fi
if [ -f "$OUT_DIR/bandwidth.log" ]; then
  target=$(grep '^target:' "$OUT_DIR/bandwidth.log")
  echo "  bandwidth: ${target:-no target line}"
  case $target in *PASS*) ;; *) overall=1 ;; esac
fi
[ "${STATUS[build]}" = PASS ] || tail -n 30 "$OUT_DIR/build.log" | sed 's/^/    build| /'
echo "  logs:      $OUT_DIR  (total $(( $(date +%s) - T0 ))s)"
[ "$DEVICE" = cpu ] && echo "  REHEARSAL on the CPU: $([ $overall = 0 ] && echo "every step ran" || echo "a step failed")"
exit "$overall"

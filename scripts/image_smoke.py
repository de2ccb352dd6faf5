#!/usr/bin/env python3
"""What a user does with a running kvsentry container; scripts/image_test.sh runs it.

    image_smoke.py ready    URL CONTAINER TIMEOUT   wait for /health then /ready; prints seconds
    image_smoke.py chat     URL                     the default model answers, metrics are there
    image_smoke.py drain    URL CONTAINER           `docker stop` during a stream: it finishes, exit 0

Needs the `openai` client (the project's .venv has it, from the test extra).
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

# The image serves with its defaults, int8 activations where the CPU has VNNI. Asked for the
# capital of France, the default model's first token is a near-tie even on the exact weights
# ("The" over "L" by 0.08 nats in float32), so int8 (like llama-server) answers "L'Étoile, ...".
# Japan's answer leads by 2.5 nats on every path: a wrong answer here means broken kernels.
QUESTION = [{"role": "user", "content": "What is the capital of Japan?"}]
ANSWER = "Tokyo"


def fail(message: str) -> None:
    print(f"image_smoke: FAIL {message}", file=sys.stderr)
    sys.exit(1)


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        return 0, str(e)


def running(container: str) -> bool:
    out = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", container],
                         capture_output=True, text=True)
    return out.stdout.strip() == "true"


def ready(url: str, container: str, timeout: float) -> None:
    started = time.monotonic()
    health_at = None
    while time.monotonic() - started < timeout:
        if not running(container):
            fail(f"container {container} exited before /ready")
        if health_at is None and get(f"{url}/health", 2)[0] == 200:
            health_at = time.monotonic() - started
        if health_at is not None and get(f"{url}/ready", 2)[0] == 200:
            print(f"{health_at:.1f} {time.monotonic() - started:.1f}")
            return
        time.sleep(0.25)
    fail(f"/ready not 200 within {timeout:.0f} s (/health {'up' if health_at else 'down'})")


def client(url: str):
    from openai import OpenAI
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(url: str) -> None:
    c = client(url)
    models = [m.id for m in c.models.list().data]
    if len(models) != 1:
        fail(f"/v1/models: {models}")
    response = c.chat.completions.create(model=models[0], messages=QUESTION, temperature=0, max_tokens=48)
    answer = response.choices[0].message.content
    print(f"image_smoke: {models[0]}: {QUESTION[0]['content']!r} -> {answer!r}", file=sys.stderr)
    if ANSWER not in answer:
        fail(f"the answer has no {ANSWER!r}: {answer!r}")
    if response.choices[0].finish_reason != "stop":
        fail(f"finish_reason {response.choices[0].finish_reason!r}, expected 'stop'")

    status, metrics = get(f"{url}/metrics")
    if status != 200:
        fail(f"/metrics: HTTP {status}")
    samples = {}
    for line in metrics.splitlines():
        if line.startswith("kvsentry_kv_cache_nan") or line.startswith("kvsentry_op_implementation_info"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    nan_values = {k: v for k, v in samples.items() if k.startswith("kvsentry_kv_cache_nan_values{")}
    detections = {k: v for k, v in samples.items() if k.startswith("kvsentry_kv_cache_nan_detections")}
    if not nan_values or not detections:
        fail("/metrics has no kvsentry_kv_cache_nan_values / kvsentry_kv_cache_nan_detections samples")
    if any(v != 0 for v in list(nan_values.values()) + list(detections.values())):
        fail(f"the NaN sentinel reports poisoned KV blocks: {nan_values} {detections}")
    kernel = [k for k, v in samples.items() if k.startswith("kvsentry_op_implementation_info") and v == 1
              and 'op="paged_attention"' in k]
    if not kernel or 'implementation="cpu_kernel"' not in kernel[0]:
        fail(f"paged_attention does not run the CPU kernel: {kernel}")
    print(f"image_smoke: /metrics: {len(nan_values)} kvsentry_kv_cache_nan_values samples (all 0), "
          f"{len(detections)} kvsentry_kv_cache_nan_detections (0); {kernel[0]}", file=sys.stderr)


def drain(url: str, container: str) -> None:
    c = client(url)
    model = c.models.list().data[0].id
    max_tokens = 120
    stream = c.chat.completions.create(
        model=model, temperature=0, max_tokens=max_tokens, stream=True,
        messages=[{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    stopper: threading.Thread | None = None
    stop_result: dict[str, object] = {}
    text, chunks_after_stop, finish, usage = "", 0, None, None

    def stop() -> None:
        started = time.monotonic()
        stop_result["proc"] = subprocess.run(["docker", "stop", "-t", "90", container], capture_output=True, text=True)
        stop_result["seconds"] = time.monotonic() - started

    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
        if stopper is None and len(text) > 20:
            stopper = threading.Thread(target=stop)  # SIGTERM mid-stream
            stopper.start()
            time.sleep(0.5)  # let the signal land while tokens are still coming
        elif stopper is not None:
            chunks_after_stop += 1
    if stopper is None:
        fail("the stream ended before it could be interrupted")
    stopper.join()
    proc = stop_result["proc"]
    if proc.returncode != 0:
        fail(f"docker stop: {proc.stderr}")
    if finish != "length" or usage is None or usage.completion_tokens != max_tokens:
        fail(f"the in-flight stream did not complete: finish_reason={finish!r} usage={usage}")
    if chunks_after_stop == 0:
        fail("no tokens arrived after SIGTERM")
    code = subprocess.run(["docker", "inspect", "-f", "{{.State.ExitCode}} {{.State.OOMKilled}}", container],
                          capture_output=True, text=True).stdout.split()
    if code[0] != "0":
        fail(f"container exit code {code[0]} (OOMKilled {code[1]}) after SIGTERM, expected 0")
    print(f"image_smoke: SIGTERM mid-stream: the stream finished ({usage.completion_tokens} tokens, "
          f"{chunks_after_stop} chunks after the signal), container exited 0 after "
          f"{stop_result['seconds']:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "ready":
        ready(args[0], args[1], float(args[2]))
    elif command == "chat":
        chat(args[0])
    elif command == "drain":
        drain(args[0], args[1])
    else:
        fail(f"unknown command {command}; {json.dumps(sys.argv)}")

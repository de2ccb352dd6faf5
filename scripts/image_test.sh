#!/usr/bin/env bash
# The container image, built and run as a user would (CI runs it after the test suite):
#
#   bash scripts/image_test.sh
#
#  1. starts dockerd if none answers (installing Debian's docker.io when missing);
#  2. builds the CPU image kvsentry:0.1.0-cpu (the tag deploy/k8s/overlays/cpu deploys)
#     from this checkout. Where no container registry is reachable it builds FROM a local
#     Debian base (scripts/image_base.sh; PYTHON_IMAGE=default uses the Dockerfile's
#     python:3.11-slim), takes torch from pip's find-links when the +cpu wheel is there, and
#     hands pip's CA bundle / index config to the builder as BuildKit secrets;
#  3. checks the runtime image's files (scripts/image_check.py: no compiler, caches, test
#     extras or the build machine's CA; non-root user);
#  4. runs it like the pods do (read-only root, tmpfs at /tmp and the cache dir, no
#     capabilities, port published on 127.0.0.1 only), waits for /health and /ready,
#     checks the prebuilt CPU attention kernel loaded (the rank_ops log line), asks the
#     default model a question through the openai client, scrapes the NaN-sentinel
#     metrics, then `docker stop`s it during a stream: the stream must finish and the
#     container exit 0 (scripts/image_smoke.py).
#
# Removes its container, temp files and the dockerd it started; keeps the images
# (kvsentry:0.1.0-cpu, the base, the torch wheel image) and Docker's build cache, so a
# second run rebuilds only what changed. KEEP_CONTAINER=1 leaves the container for a look.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-kvsentry:0.1.0-cpu}
BASE_IMAGE=${PYTHON_IMAGE:-kvsentry-base:bookworm}
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
READY_TIMEOUT=${READY_TIMEOUT:-600}
PY=${PYTHON:-.venv/bin/python}
WORK=$(mktemp -d /tmp/kvsentry-image-test.XXXXXX)
CONTAINER=kvsentry-image-test-$$
DOCKERD_PID=
T0=$SECONDS

log() { echo "image_test: $*" >&2; }
die() { log "FAIL: $*"; exit 1; }
cleanup() {
    local rc=$?
    if [ -z "${KEEP_CONTAINER:-}" ]; then docker rm -f "$CONTAINER" >/dev/null 2>&1 || true; fi
    docker rm -f "$CONTAINER-files" >/dev/null 2>&1 || true
    rm -rf "$WORK"
    if [ -n "$DOCKERD_PID" ]; then kill "$DOCKERD_PID" 2>/dev/null && wait "$DOCKERD_PID" 2>/dev/null || true; fi
    [ $rc -eq 0 ] && log "PASS in $((SECONDS - T0)) s" || log "failed after $((SECONDS - T0)) s"
}
trap cleanup EXIT

"$PY" -c "import openai" 2>/dev/null || die "$PY has no openai client (bash scripts/bootstrap installs the test extra)"

# ---- 1. dockerd -----------------------------------------------------------------------
if ! docker info >/dev/null 2>&1; then
    if ! command -v dockerd >/dev/null; then
        log "installing docker.io"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
    fi
    log "starting dockerd (log: /tmp/kvsentry-dockerd.log)"
    dockerd >/tmp/kvsentry-dockerd.log 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { tail -n 20 /tmp/kvsentry-dockerd.log >&2; die "dockerd did not start"; }
fi

# A build command with BuildKit (the Dockerfile's secret and bind mounts need it): buildx
# where installed, else a docker CLI older than 23 (Debian bookworm's docker.io), whose
# built-in BuildKit client DOCKER_BUILDKIT=1 enables.
BUILD=()
if docker buildx version >/dev/null 2>&1; then
    BUILD=(docker buildx build --load)
else
    for cli in docker /usr/bin/docker; do
        major=$("$cli" version -f '{{.Client.Version}}' 2>/dev/null | cut -d. -f1) || continue
        if [ -n "$major" ] && [ "$major" -lt 23 ]; then BUILD=(env DOCKER_BUILDKIT=1 "$cli" build); break; fi
    done
fi
[ ${#BUILD[@]} -gt 0 ] || die "no BuildKit: install docker-buildx, or use Debian's docker.io CLI"

# ---- 2. build -------------------------------------------------------------------------
ARGS=(--progress=plain -t "$IMAGE")
if [ "$BASE_IMAGE" != default ]; then
    if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        log "building the base image $BASE_IMAGE"
        t=$SECONDS; bash scripts/image_base.sh "$BASE_IMAGE"; log "base image: $((SECONDS - t)) s"
    fi
    ARGS+=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE")
fi

# pip's settings on this machine, as the builder needs them (read from pip itself).
pip_config() { "$PY" -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.$1='\(.*\)'$/\1/p" | tail -n1; }
CERT=${PIP_CERT:-$(pip_config cert)}
INDEX_URL=${PIP_INDEX_URL:-$(pip_config index-url)}
EXTRA_INDEX=$(for u in ${PIP_EXTRA_INDEX_URL:-$(pip_config extra-index-url)}; do case $u in file:*) ;; *) echo -n "$u ";; esac; done)
FIND_LINKS=${PIP_FIND_LINKS:-$(pip_config find-links)}

# torch: the CPU wheel from find-links when it is there (an image holding only it).
WHEEL=
for d in $FIND_LINKS; do
    d=${d#file://}
    for w in "$d"/torch-"$TORCH_VERSION"+cpu-*.whl; do [ -f "$w" ] && WHEEL=$w && break 2; done
done
if [ -n "$WHEEL" ]; then
    WHEELS_IMAGE=kvsentry-wheels:torch-$TORCH_VERSION-cpu
    if ! docker image inspect "$WHEELS_IMAGE" >/dev/null 2>&1; then
        mkdir "$WORK/wheels"
        ln "$WHEEL" "$WORK/wheels/" 2>/dev/null || cp "$WHEEL" "$WORK/wheels/"
        printf 'FROM scratch\nCOPY *.whl /\n' > "$WORK/wheels/Dockerfile"
        "${BUILD[@]}" -q -t "$WHEELS_IMAGE" "$WORK/wheels" >/dev/null
        rm -rf "$WORK/wheels"
    fi
    ARGS+=(--build-arg "WHEELS_IMAGE=$WHEELS_IMAGE")
    log "torch from $WHEEL"
fi

# The builder's pip config: a BuildKit secret, as is the CA bundle it names.
: > "$WORK/pip.conf"
echo "[global]" >> "$WORK/pip.conf"
[ -n "$INDEX_URL" ] && echo "index-url = $INDEX_URL" >> "$WORK/pip.conf"
[ -n "$EXTRA_INDEX" ] && echo "extra-index-url = $EXTRA_INDEX" >> "$WORK/pip.conf"
if [ -n "$CERT" ] && [ -f "$CERT" ]; then
    echo "cert = /run/secrets/pip_ca" >> "$WORK/pip.conf"
    ARGS+=(--secret "id=pip_ca,src=$CERT")
fi
ARGS+=(--secret "id=pip_conf,src=$WORK/pip.conf")

log "building $IMAGE: ${BUILD[*]} ${ARGS[*]} ."
t=$SECONDS
"${BUILD[@]}" "${ARGS[@]}" . > "$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log" >&2; die "docker build"; }
log "build: $((SECONDS - t)) s; image $(docker image inspect -f '{{.Size}}' "$IMAGE") bytes uncompressed"

# ---- 3. what the runtime image holds --------------------------------------------------
USER_=$(docker image inspect -f '{{.Config.User}}' "$IMAGE")
docker create --name "$CONTAINER-files" "$IMAGE" >/dev/null
HOST_CA=()
for ca in $(printf '%s\n' "$CERT" /etc/ssl/certs/ca-certificates.crt | sort -u); do
    if [ -f "$ca" ]; then HOST_CA+=(--host-ca "$ca"); fi
done
docker export "$CONTAINER-files" | "$PY" scripts/image_check.py - --user "$USER_" "${HOST_CA[@]}" \
    || die "the runtime image holds what it must not (above)"
docker rm "$CONTAINER-files" >/dev/null

# ---- 4. run it ------------------------------------------------------------------------
t=$SECONDS
docker run -d --name "$CONTAINER" -p 127.0.0.1::8000 \
    --read-only --tmpfs /tmp --tmpfs /var/cache/kvsentry:uid=10001,gid=10001,mode=0750 \
    --cap-drop ALL --security-opt no-new-privileges \
    "$IMAGE" >/dev/null
PORT=$(docker port "$CONTAINER" 8000/tcp | head -n1 | sed 's/.*://')
URL=http://127.0.0.1:$PORT
TIMES=$("$PY" scripts/image_smoke.py ready "$URL" "$CONTAINER" "$READY_TIMEOUT") \
    || { docker logs --tail 40 "$CONTAINER" >&2; die "not ready"; }
read -r HEALTH_S READY_S <<< "$TIMES"
log "docker run -> /health ${HEALTH_S} s, /ready ${READY_S} s"

[ "$(docker exec "$CONTAINER" id -u)" = 10001 ] || die "the server does not run as uid 10001"
for _ in $(seq 40); do  # /ready can answer a moment before the line is written
    docker logs "$CONTAINER" > "$WORK/server.log" 2>&1
    OPS=$(grep '"rank_ops"' "$WORK/server.log" || true)
    [ -n "$OPS" ] && break
    sleep 0.25
done
# The image is built for AVX2 (any x86-64-v3 node): every kernel runs but the AVX-512 panel
# GEMMs, whose linears stay on oneDNN, and the AVX512-VNNI int8 GEMM (opt-in, its torch reference
# there); any other fallback fails the test.
grep -q 'paged_attention=cpu_kernel' <<< "$OPS" \
    || { cat "$WORK/server.log" >&2; die "the rank_ops line does not show the prebuilt CPU kernel: $OPS"; }
FALLBACKS=$(sed -n 's/.*"fallbacks": \[\([^]]*\)\].*/\1/p' <<< "$OPS" | tr -d '" ' | tr ',' '\n' \
            | grep -v -x -E 'bf16_gemm|f32_gemm|int8_gemm' || true)
[ -z "$FALLBACKS" ] || { cat "$WORK/server.log" >&2; die "kernels on their fallback in the image: $FALLBACKS"; }
# ...and it is the library the builder compiled: mapped from /opt/kvsentry-ops by the rank.
LIBS=$(docker exec "$CONTAINER" sh -c 'cat /proc/[0-9]*/maps 2>/dev/null' | awk '/kvsentry_ops/ {print $6}' | sort -u)
case $LIBS in /opt/kvsentry-ops/*/kvsentry_ops_cpu.so) ;; *) die "the CPU kernel is not the prebuilt one: ${LIBS:-none loaded}";; esac
log "start-up: $(grep -o '"ops": "[^"]*"' <<< "$OPS" | head -n1), loaded from $LIBS"

"$PY" scripts/image_smoke.py chat "$URL" || { docker logs --tail 40 "$CONTAINER" >&2; die "chat"; }
"$PY" scripts/image_smoke.py drain "$URL" "$CONTAINER" || { docker logs --tail 40 "$CONTAINER" >&2; die "drain"; }
docker logs "$CONTAINER" > "$WORK/server.log" 2>&1
grep -q '"event": "drained", "left": 0' "$WORK/server.log" || die "no drained event (left 0) in the log"

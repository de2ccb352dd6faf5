#!/usr/bin/env bash
# Make a local Debian bookworm base image with python3.11 (+ venv), for building the
# Dockerfile where no container registry is reachable:
#
#   scripts/image_base.sh [IMAGE]        # default kvsentry-base:bookworm
#   docker build --build-arg PYTHON_IMAGE=kvsentry-base:bookworm ...
#
# debootstrap (minbase) from the Debian mirror apt on this machine uses (override with
# DEBIAN_MIRROR), ~1 min and ~280 MB. The root filesystem tarball is cached in
# ~/.cache/kvsentry/ (KVSENTRY_IMAGE_CACHE), so a lost image is re-imported in seconds.
# Nothing of this machine goes in: no resolv.conf, hostname, apt lists or .debs.
set -euo pipefail

IMAGE=${1:-kvsentry-base:bookworm}
SUITE=bookworm
CACHE=${KVSENTRY_IMAGE_CACHE:-$HOME/.cache/kvsentry}
TARBALL=$CACHE/base-$SUITE-rootfs.tar

host_mirror() {
    # The first Debian URI in apt's sources (deb822 or one-line format).
    local uri
    uri=$(grep -hsE '^\s*URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v -- '-security' | head -n1 || true)
    if [ -z "$uri" ]; then
        uri=$(grep -hsE '^\s*deb\s' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
              | awk '{for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' | grep -v -- '-security' | head -n1 || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

if ! [ -s "$TARBALL" ]; then
    command -v debootstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; }
    MIRROR=${DEBIAN_MIRROR:-$(host_mirror)}
    mkdir -p "$CACHE"
    ROOT=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$ROOT"' EXIT
    echo "image_base: debootstrap $SUITE from $MIRROR" >&2
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$SUITE" "$ROOT" "$MIRROR" > "$CACHE/debootstrap.log" 2>&1 \
        || { tail -n 30 "$CACHE/debootstrap.log" >&2; exit 1; }
    # What debootstrap copies from or leaves of the build machine; Docker provides
    # resolv.conf, hostname and hosts at run time.
    rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/log/* \
           "$ROOT"/debootstrap "$ROOT"/tmp/* "$ROOT"/root/.cache
    # As in Debian's official images: apt deletes the .debs it fetched after each install.
    cat > "$ROOT/etc/apt/apt.conf.d/docker-clean" <<'CONF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
CONF
    : > "$ROOT/etc/resolv.conf"
    : > "$ROOT/etc/hostname"
    cat > "$ROOT/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
EOF
    tar --numeric-owner -C "$ROOT" -cf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
fi

docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "debootstrap --variant=minbase $SUITE + python3, python3-venv, ca-certificates" \
    "$TARBALL" "$IMAGE" >/dev/null
echo "image_base: $IMAGE" >&2

#!/usr/bin/env bash
# A stand-in base image for machines that reach no container registry: Debian (the host's own suite
# by default) with Python, venv, the compiler the CPU kernels build with, and the host's CA
# certificates, so that pip inside the image trusts the same TLS proxy the host trusts.
#
#   bash scripts/docker_base.sh [TAG]        # default tag: aflex-base:debian
#   docker build -f compose/Dockerfile --build-arg BASE_IMAGE=aflex-base:debian ...
#
# Made with mmdebstrap from Debian's archive (~90 s, ~400 MB) and `docker import`ed: no registry,
# no Dockerfile frontend. Needs root (mmdebstrap's root mode) and installs mmdebstrap if missing.
set -euo pipefail

TAG="${1:-aflex-base:debian}"
SUITE="${AFLEX_BASE_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")}"
MIRROR="${AFLEX_BASE_MIRROR:-http://deb.debian.org/debian}"
PACKAGES="python3,python3-venv,python3-dev,g++,ca-certificates,tini"

if ! command -v mmdebstrap >/dev/null; then
  echo "docker_base: installing mmdebstrap" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null; }
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "docker_base: $SUITE minbase + $PACKAGES -> $TAG" >&2
# The host's CA bundle goes in after the packages (ca-certificates would regenerate it otherwise),
# and pip is pointed at it: the Debian bundle alone does not hold a TLS proxy's CA.
mmdebstrap --quiet --variant=minbase --include="$PACKAGES" \
  --customize-hook='mkdir -p "$1/usr/local/share/ca-certificates/host"' \
  --customize-hook="copy-in /etc/ssl/certs/ca-certificates.crt /usr/local/share/ca-certificates/host/" \
  --customize-hook='mv "$1/usr/local/share/ca-certificates/host/ca-certificates.crt" "$1/usr/local/share/ca-certificates/host/host-bundle.crt"' \
  --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
  "$SUITE" "$work/rootfs.tar" "$MIRROR"
docker import \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  "$work/rootfs.tar" "$TAG" >/dev/null
echo "docker_base: built $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))" >&2

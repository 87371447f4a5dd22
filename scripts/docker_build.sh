#!/usr/bin/env bash
# Builds the AFlex image from this checkout on any machine with a Docker engine, registry or not.
#
#   bash scripts/docker_build.sh            # aflex:cpu (every service; workers on the CPU)
#   AFLEX_TARGET=cuda bash scripts/docker_build.sh   # aflex:cuda
#
# - The base image: AFLEX_BASE_IMAGE, else python:3.11-slim where it is present or can be pulled, else
#   a stand-in made from Debian's archive (scripts/docker_base.sh, tagged aflex-base:debian).
# - torch (cpu target): the host's pip fetches the CPU build into compose/wheels/ (git-ignored), which
#   the Dockerfile installs before any index: pip inside a container does not see the host's pip
#   configuration (on this machine kind the wheel lies on disk, not on an index). Where the host's pip
#   cannot fetch it, the image downloads it from TORCH_INDEX_URL instead.
# - The legacy builder (DOCKER_BUILDKIT=0): it needs neither buildx nor a frontend image.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET="${AFLEX_TARGET:-cpu}"
TAG="${AFLEX_IMAGE:-aflex:$TARGET}"
TORCH_VERSION="${AFLEX_TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"

base="${AFLEX_BASE_IMAGE:-}"
if [ -z "$base" ]; then
  if docker image inspect python:3.11-slim >/dev/null 2>&1 \
     || timeout 60 docker pull --quiet python:3.11-slim >/dev/null 2>&1; then
    base=python:3.11-slim
  else
    base=aflex-base:debian
    docker image inspect "$base" >/dev/null 2>&1 || bash scripts/docker_base.sh "$base"
  fi
fi

if [ "$TARGET" = cpu ] && ! ls compose/wheels/torch-"$TORCH_VERSION"*.whl >/dev/null 2>&1; then
  # The image's Python is 3.11 (python:3.11-slim, Debian bookworm): fetch the wheel for it, whatever the host runs.
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --platform manylinux_2_28_x86_64 -d compose/wheels "torch==$TORCH_VERSION" \
    || echo "docker_build: the host's pip found no torch $TORCH_VERSION wheel; the image will download it" >&2
fi

echo "docker_build: $TAG (target $TARGET) on $base" >&2
DOCKER_BUILDKIT=0 docker build --quiet -f compose/Dockerfile --target "$TARGET" \
  --build-arg BASE_IMAGE="$base" --build-arg TORCH_VERSION="$TORCH_VERSION" -t "$TAG" . >/dev/null
echo "docker_build: built $TAG ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))" >&2

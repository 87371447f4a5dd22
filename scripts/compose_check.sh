#!/usr/bin/env bash
# The compose stack for real, on this machine: Docker made ready, the image built from this checkout,
# then tools/compose_check.py (up, the engine's answer through the openai client, a worker crash
# mid-stream, `docker compose stop` draining mid-stream, `down -v`). `.ci/run` runs it after the tests.
#
#   bash scripts/compose_check.sh
#
# Where they are missing (Debian, as root): Debian's docker.io, and the compose v2 plugin from Debian
# trixie's docker-compose package (bookworm's docker-compose is v1, which rejects compose.yaml's `name`);
# a Docker engine is started if none answers. Images: scripts/docker_build.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
say() { echo "compose_check: $*" >&2; }

if ! command -v dockerd >/dev/null && ! docker info >/dev/null 2>&1; then
  say "installing Debian's docker.io"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null; }
fi

if ! docker compose version >/dev/null 2>&1; then
  say "installing the compose v2 plugin (Debian trixie's docker-compose package)"
  d="$(mktemp -d)"
  mkdir -p "$d/lists/partial" "$d/archives/partial" "$d/etc"
  printf 'Types: deb\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "${AFLEX_DEBIAN_MIRROR:-http://deb.debian.org/debian}" > "$d/etc/trixie.sources"
  apt_opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$d/etc" -o "Dir::State::Lists=$d/lists"
            -o "Dir::Cache::Archives=$d/archives" -o "Dir::Cache=$d" -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -qq
  (cd "$d" && apt-get "${apt_opts[@]}" download docker-compose >/dev/null)
  dpkg-deb -x "$d"/docker-compose_*.deb "$d/x"
  mkdir -p /usr/libexec/docker/cli-plugins
  install -m 0755 "$d/x/usr/libexec/docker/cli-plugins/docker-compose" /usr/libexec/docker/cli-plugins/
  rm -rf "$d"
fi

if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log: /tmp/aflex-dockerd.log)"
  nohup dockerd >/tmp/aflex-dockerd.log 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { say "dockerd did not start:"; tail -20 /tmp/aflex-dockerd.log >&2; exit 1; }
fi
say "$(docker compose version), engine $(docker info -f '{{.ServerVersion}}'), ready after $((SECONDS - start)) s"

bash scripts/docker_build.sh
say "image built after $((SECONDS - start)) s"

# The check's client side: the project's venv (openai, nats-py), made as the test command makes it.
[ -x .venv/bin/python ] && .venv/bin/python -c 'import openai' 2>/dev/null || scripts/install.sh worker,dev
.venv/bin/python -m tools.compose_check --image "${AFLEX_IMAGE:-aflex:cpu}"
say "all done in $((SECONDS - start)) s"

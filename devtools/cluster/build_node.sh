#!/usr/bin/env bash
# Builds the real node's container runtime into a cache folder keyed by node.env and the Kubernetes
# pin, and prints that folder's bin/ path last: containerd, ctr and containerd-shim-runc-v2 from
# containerd's Go module, and pause (the pod sandbox's program) compiled statically from the
# Kubernetes module's build/pause/linux/pause.c. A warm cache returns at once; progress goes to
# stderr. kubelet and kube-proxy are build.sh's, from the same Kubernetes module as the plane.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=node.env
source "$here/node.env"
# shellcheck source=versions.env
source "$here/versions.env"
key=$(cat "$here/node.env" "$here/versions.env" | sha256sum | cut -c1-12)
cache_root=${SPECDECODE_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specdecode/cluster}
out="$cache_root/node-$key"
bin="$out/bin"
tools="containerd ctr containerd-shim-runc-v2 pause"
all_built() { for t in $tools; do [ -x "$bin/$t" ] || return 1; done; }
if all_built; then echo "$bin"; exit 0; fi

for need in go gcc; do
  if ! command -v $need >/dev/null; then
    echo "build_node.sh: $need is needed to build the real node's runtime (containerd $CONTAINERD_VERSION, pause)" >&2
    exit 1
  fi
done
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$bin" "$out/src"
exec 9>"$out/.build.lock"
if ! flock -n 9; then
  printf '[node-build] another build of %s is running; waiting for it\n' "$out" >&2
  flock 9
fi
if all_built; then echo "$bin"; exit 0; fi
log() { printf '[node-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
start=$(date +%s)
GOV=$(go env GOVERSION | sed -E 's/^go([0-9]+\.[0-9]+).*/\1/')

d="$out/src/containerd"
mkdir -p "$d" && cd "$d"
printf 'module specdecode.local/containerd-bin\n\ngo %s.0\n\nrequire github.com/containerd/containerd/v2 v%s\n' \
  "$GOV" "$CONTAINERD_VERSION" > go.mod
printf '//go:build tools\n\npackage tools\n\nimport (\n' > tools.go
for c in containerd ctr containerd-shim-runc-v2; do
  printf '\t_ "github.com/containerd/containerd/v2/cmd/%s"\n' "$c" >> tools.go
done
printf ')\n' >> tools.go
log "containerd v$CONTAINERD_VERSION: resolving modules (go mod tidy)"
go mod tidy >&2
ld="-s -w -X github.com/containerd/containerd/v2/version.Version=v$CONTAINERD_VERSION"
for c in containerd ctr containerd-shim-runc-v2; do
  if [ -x "$bin/$c" ]; then log "$c: cached"; continue; fi
  t0=$(date +%s)
  log "$c: compiling"
  # No btrfs, devmapper or zfs snapshotters: the node uses overlayfs, and those need cgo.
  go build -p 2 -trimpath -tags "no_btrfs no_devmapper no_zfs" -ldflags "$ld" -o "$bin/$c.tmp" \
    "github.com/containerd/containerd/v2/cmd/$c"
  mv "$bin/$c.tmp" "$bin/$c"
  log "$c: done in $(( $(date +%s) - t0 ))s"
done

if [ ! -x "$bin/pause" ]; then
  kdir=$(go mod download -json "k8s.io/kubernetes@v$KUBERNETES_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  log "pause $PAUSE_VERSION: compiling $kdir/build/pause/linux/pause.c"
  gcc -Os -static -Wall -Werror -DVERSION="$PAUSE_VERSION" -o "$bin/pause.tmp" "$kdir/build/pause/linux/pause.c"
  mv "$bin/pause.tmp" "$bin/pause"
fi
log "real node runtime ready in $(( $(date +%s) - start ))s: $bin"
echo "$bin"

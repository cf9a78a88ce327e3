#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok, helm and the
# real node's kubelet and kube-proxy (the same Kubernetes module; build_node.sh adds containerd) from
# their Go modules into a cache folder keyed by the pins, and prints that folder's bin/ path last.
# A warm cache returns at once. Progress goes to stderr. The cache key is the pins only, so
# editing this script does not rebuild: bump a pin (or delete the cache) to force a rebuild.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
key=$(sha256sum < "$here/versions.env" | cut -c1-12)
cache_root=${SPECDECODE_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specdecode/cluster}
out="$cache_root/$key"
bin="$out/bin"
kube_cmds="kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy"
tools="etcd kwok helm $kube_cmds"

all_built() { for t in $tools; do [ -x "$bin/$t" ] || return 1; done; }
if all_built; then echo "$bin"; exit 0; fi

if ! command -v go >/dev/null; then
  echo "build.sh: Go is needed to build the local control plane (Go 1.26 or newer for Kubernetes $KUBERNETES_VERSION)" >&2
  exit 1
fi
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$bin" "$out/src"
# One build at a time per cache folder (CI, a test run and `make cluster-up` may start together);
# whoever waited finds the binaries built.
exec 9>"$out/.build.lock"
if ! flock -n 9; then
  printf '[cluster-build] another build of %s is running; waiting for it\n' "$out" >&2
  flock 9
fi
if all_built; then echo "$bin"; exit 0; fi
log() { printf '[cluster-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
start=$(date +%s)
step() { # name, then a command that builds it
  local name=$1; shift
  if [ -x "$bin/$name" ]; then log "$name: cached"; return; fi
  local t0; t0=$(date +%s)
  log "$name: building"
  "$@"
  log "$name: done in $(( $(date +%s) - t0 ))s"
}

K=$KUBERNETES_VERSION
S=0.${K#1.}
MINOR=$(echo "$K" | cut -d. -f2)
GOV=$(go env GOVERSION | sed -E 's/^go([0-9]+\.[0-9]+).*/\1/')

build_kubernetes() {
  local c missing=0
  for c in $kube_cmds; do [ -x "$bin/$c" ] || missing=1; done
  if [ $missing = 0 ]; then log "kubernetes binaries: cached"; return; fi
  local d="$out/src/kubernetes"
  mkdir -p "$d" && cd "$d"
  cat > go.mod <<MOD
module specdecode.local/k8s-bins

go $GOV.0

godebug default=go$GOV

require k8s.io/kubernetes v$K
MOD
  cat > tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
GO
  # kubernetes replaces its staging modules with local folders; a dependency's replaces are
  # ignored, so pin each one to the matching published v0.<minor>.<patch> tag.
  local kmod
  kmod=$(go mod download -json "k8s.io/kubernetes@v$K" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  local staging
  staging=$(sed -nE 's#^\s*(k8s\.io/[a-z0-9-]+) => \./staging/src/.*#\1#p' "$kmod" | sort -u)
  log "kubernetes v$K: pinning $(echo "$staging" | wc -l) staging modules to v$S"
  for m in $staging; do go mod edit -replace="$m=$m@v$S"; done
  log "kubernetes: resolving modules (go mod tidy)"
  go mod tidy -e >&2 2>&1 || go mod tidy >&2
  local ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $p.gitVersion=v$K -X $p.gitMajor=1 -X $p.gitMinor=$MINOR -X $p.gitTreeState=clean -X $p.buildDate=2026-01-01T00:00:00Z"
  done
  for c in $kube_cmds; do
    if [ -x "$bin/$c" ]; then log "$c: cached"; continue; fi
    local t0; t0=$(date +%s)
    log "$c: compiling (the first one compiles most shared packages)"
    go build -p 2 -trimpath -tags selinux,notest,grpcnotrace -ldflags "$ld" -o "$bin/$c.tmp" "k8s.io/kubernetes/cmd/$c"
    mv "$bin/$c.tmp" "$bin/$c"
    log "$c: done in $(( $(date +%s) - t0 ))s"
  done
}

build_single() { # name module-path main-package version [ldflags]
  local name=$1 mod=$2 pkg=$3 ver=$4 ld=${5:-}
  local d="$out/src/$name"
  mkdir -p "$d" && cd "$d"
  printf 'module specdecode.local/%s-bin\n\ngo %s.0\n\nrequire %s v%s\n' "$name" "$GOV" "$mod" "$ver" > go.mod
  printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$pkg" > tools.go
  go mod tidy >&2
  go build -p 2 -trimpath -ldflags "-s -w $ld" -o "$bin/$name.tmp" "$pkg"
  mv "$bin/$name.tmp" "$bin/$name"
}

step etcd build_single etcd go.etcd.io/etcd/server/v3 go.etcd.io/etcd/server/v3 "$ETCD_VERSION"
step kwok build_single kwok sigs.k8s.io/kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" \
  "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"
step helm build_single helm helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm "$HELM_VERSION" \
  "-X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION"
build_kubernetes
log "all binaries ready in $(( $(date +%s) - start ))s: $bin"
echo "$bin"

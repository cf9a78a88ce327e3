#!/usr/bin/env bash
# Builds the LeaderWorkerSet controller from the pinned source snapshot (lws.env) into a cache
# folder keyed by that pin, copies its CRDs next to it, and prints the folder last
# (bin/lws-controller, crd/*.yaml: LeaderWorkerSet, and the DisaggregatedSet kinds the same
# controller manager watches). A warm cache returns at once.
# The snapshot is looked up in $SPECDECODE_THIRD_PARTY, then ../shared/third_party beside the
# checkout, then /work/shared/third_party; its sha256 must match the pin.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lws.env
source "$here/lws.env"
key=$(sha256sum < "$here/lws.env" | cut -c1-12)
cache_root=${SPECDECODE_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specdecode/cluster}
out="$cache_root/lws-$key"
crds="leaderworkersets disaggregatedsets disaggregatedsetrolescalers"
have_crds() { for c in $crds; do [ -f "$out/crd/$c.yaml" ] || return 1; done; }
built() { [ -x "$out/bin/lws-controller" ] && have_crds; }
if built; then echo "$out"; exit 0; fi

find_tarball() {
  local d
  for d in "${SPECDECODE_THIRD_PARTY:-}" "$here/../../../shared/third_party" /work/shared/third_party; do
    if [ -n "$d" ] && [ -f "$d/$LWS_TARBALL" ]; then echo "$d/$LWS_TARBALL"; return; fi
  done
  echo "build_lws.sh: $LWS_TARBALL not found; set SPECDECODE_THIRD_PARTY to the folder holding it" >&2
  exit 1
}
if [ ! -x "$out/bin/lws-controller" ] && ! command -v go >/dev/null; then
  echo "build_lws.sh: Go 1.26 or newer is needed to build the LeaderWorkerSet controller" >&2
  exit 1
fi
mkdir -p "$out"
exec 9>"$out/.build.lock"
if ! flock -n 9; then
  printf '[lws-build] another build of %s is running; waiting for it\n' "$out" >&2
  flock 9
fi
if built; then echo "$out"; exit 0; fi
log() { printf '[lws-build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
start=$(date +%s)
tarball=$(find_tarball)
echo "$LWS_TARBALL_SHA256  $tarball" | sha256sum -c --quiet - >&2 || {
  echo "build_lws.sh: $tarball does not match the sha256 pinned in lws.env" >&2; exit 1; }
rm -rf "$out/src" && mkdir -p "$out/src" "$out/bin" "$out/crd"
tar -xzf "$tarball" -C "$out/src"
cd "$out/src/lws"
for c in $crds; do
  cp config/crd/bases/*_"$c".yaml "$out/crd/$c.yaml"
done
if [ ! -x "$out/bin/lws-controller" ]; then
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod
  log "lws ${LWS_COMMIT:0:7}: downloading modules"
  go mod download >&2
  log "lws ${LWS_COMMIT:0:7}: compiling the controller"
  go build -p 2 -trimpath -ldflags "-s -w -X sigs.k8s.io/lws/pkg/version.GitCommit=$LWS_COMMIT" \
    -o "$out/bin/lws-controller.tmp" ./cmd
  mv "$out/bin/lws-controller.tmp" "$out/bin/lws-controller"
fi
rm -rf "$out/src"
log "lws controller ready in $(( $(date +%s) - start ))s: $out"
echo "$out"

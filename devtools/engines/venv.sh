#!/usr/bin/env bash
# A cached virtualenv for another serving engine, keyed by its pins: venv.sh vllm|sglang
# prints the venv's folder, building it first when no venv with these pins exists.
# ~/.cache/specdecode/engines/<engine>-<hash of the pin file>; about 6 GB and 2-4 minutes each.
set -euo pipefail
engine="$1"
here="$(cd "$(dirname "$0")" && pwd)"
pins="$here/$engine.txt"
if [ ! -f "$pins" ]; then echo "venv.sh: unknown engine $engine (vllm or sglang)" >&2; exit 2; fi
# The engine itself, installed without its requirements: the pin file's "# no-deps:" line.
nodeps="$(sed -n 's/^# no-deps: *//p' "$pins")"
# Comments do not key the cache: only the pins and the package installed without its requirements.
key="$(cat <(grep -v '^[[:space:]]*#' "$pins") <(echo "$nodeps") | sha256sum | cut -c1-12)"
root="${SPECDECODE_CACHE:-$HOME/.cache/specdecode}/engines"
venv="$root/$engine-$key"
if [ ! -f "$venv/.installed" ]; then
  mkdir -p "$root"
  rm -rf "$venv" "$venv.partial"
  echo "venv.sh: building $venv (pins: $pins)" >&2
  python3 -m venv "$venv.partial"
  "$venv.partial/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv.partial/bin/python" -m pip install --quiet -r "$pins" >&2
  "$venv.partial/bin/python" -m pip install --quiet --no-deps "$nodeps" >&2
  # Built under another name so a cut-off build is never taken for a finished one; moving a venv
  # breaks only its console-script shebangs, and callers run `<venv>/bin/python -m ...`.
  mv "$venv.partial" "$venv"
  touch "$venv/.installed"
  for old in "$root/$engine"-*; do [ "$old" = "$venv" ] || rm -rf "$old"; done
fi
echo "$venv"

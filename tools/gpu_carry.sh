#!/usr/bin/env bash
# Carry a model's GGUF file to a machine without network whose transfers are capped (docs/bench.md, "finetune").
#
#   here:   tools/gpu_carry.sh split DEST [GGUF]       cut GGUF (default: Gemma 3 270M's, from its installed package)
#                                                      into DEST/model.gguf.partNN of 58 MiB, put the wheel of the
#                                                      `gguf` reader (and liger-kernel's when installed here) in
#                                                      DEST/whl, and write DEST/model.gguf.sha256
#   there:  tools/gpu_carry.sh stash PART... [--to DIR] copy carried parts into DIR (default /tmp/logitless-model),
#                                                      outside the repository, where they outlast the next transfer
#   there:  tools/gpu_carry.sh join OUT [DIR]           cat DIR/model.gguf.part* > OUT and check its SHA-256 against
#                                                      DIR/model.gguf.sha256 (stashed with the parts)
#
# Each transfer carries one part; the parts are plain byte ranges, so `cat` in name order rebuilds the file.
set -euo pipefail

PART_SIZE=58m
DEFAULT_DIR=/tmp/logitless-model

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

cmd=${1:-}
[ -n "$cmd" ] || usage
shift

case "$cmd" in
  split)
    dest=${1:?split needs DEST}
    gguf=${2:-}
    if [ -z "$gguf" ]; then
      gguf=$(python3 -c 'from logitless.apps.bench import real; print(real.gguf_path("gemma3-270m"))')
    fi
    mkdir -p "$dest/whl"
    rm -f "$dest"/model.gguf.part*
    split -b "$PART_SIZE" -d "$gguf" "$dest/model.gguf.part"
    (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") | awk '{print $1}' > "$dest/model.gguf.sha256"
    # The reader transformers needs for gguf_file=; pure Python, its own needs (numpy, pyyaml, requests, tqdm) are
    # common. Liger-Kernel only where it is installed here (its variant is skipped otherwise).
    for pkg in gguf liger-kernel; do
      ver=$(python3 -c "import importlib.metadata as m; print(m.version('$pkg'))" 2>/dev/null) || continue
      python3 -m pip download -q --no-deps --only-binary=:all: -d "$dest/whl" "$pkg==$ver"
    done
    ls -l "$dest" "$dest/whl"
    echo "sha256 $(cat "$dest/model.gguf.sha256")  $(basename "$gguf")"
    ;;
  stash)
    to=$DEFAULT_DIR
    parts=()
    while [ $# -gt 0 ]; do
      case "$1" in
        --to) to=${2:?--to needs DIR}; shift 2 ;;
        *) parts+=("$1"); shift ;;
      esac
    done
    [ ${#parts[@]} -gt 0 ] || usage
    mkdir -p "$to"
    cp "${parts[@]}" "$to/"
    ls -l "$to"
    ;;
  join)
    out=${1:?join needs OUT}
    dir=${2:-$DEFAULT_DIR}
    ls "$dir"/model.gguf.part* > /dev/null
    cat "$dir"/model.gguf.part* > "$out"
    if [ -f "$dir/model.gguf.sha256" ]; then
      want=$(cat "$dir/model.gguf.sha256")
      got=$(sha256sum "$out" | awk '{print $1}')
      if [ "$want" != "$got" ]; then
        echo "gpu_carry: $out has SHA-256 $got, expected $want: a part is missing or damaged" >&2
        ls -l "$dir" >&2
        exit 1
      fi
      echo "gpu_carry: $out joined from $(ls "$dir"/model.gguf.part* | wc -l) parts, SHA-256 checked"
    else
      echo "gpu_carry: $out joined; no model.gguf.sha256 in $dir, so not checked"
    fi
    ;;
  *) usage ;;
esac

#!/usr/bin/env bash
# The embedded SmolLM2 GGUF (98 MB) onto a GPU machine whose calls carry at most 64 MiB each: two parts, in two
# calls made while the machine is still warm, joined there and checked against the original's SHA-256.
#
#   benchmarks/gguf_parts.sh split        here: .gl/gguf.part1, .gl/gguf.part2 and .gl/gguf.sha256 (.gl is
#                                          ignored by git), from the embedded model of this checkout's .venv
#   benchmarks/gguf_parts.sh stash        GPU, first call (carry .gl/gguf.part1 and .gl/gguf.sha256): keeps the
#                                          part in $GGUF_DIR (default /root/gguf), outside the repository, where
#                                          it stays until the machine goes back
#   benchmarks/gguf_parts.sh join         GPU, second call (carry .gl/gguf.part2 and .gl/gguf.sha256): joins the
#                                          parts into $GGUF_DIR/smollm2.gguf, checks the SHA-256, prints the path
#
# Then, in the same second call (carrying .whl from benchmarks/gpu_wheels.sh as well: the GPU image has no
# GGUF reader, which benchmarks/gpu_env.sh installs from it):
#   SITS_SMOLLM2_GGUF=$(benchmarks/gguf_parts.sh join) STEPS="tests parity" benchmarks/gpu_engine_run.sh
set -eu
cd "$(dirname "$0")/.."
GGUF_DIR=${GGUF_DIR:-/root/gguf}
PARTS=${PARTS_DIR:-.gl}  # where split writes the parts (and the carried ones are read)
PART_BYTES=$((50 * 1024 * 1024))
case ${1:-} in
  split)
    source=$(PYTHONSAFEPATH=1 .venv/bin/python -c \
      "from sits.runtime.models.embedded import embedded_gguf_path as p; print(p())")
    mkdir -p "$PARTS"
    head -c "$PART_BYTES" "$source" >"$PARTS/gguf.part1"
    tail -c +"$((PART_BYTES + 1))" "$source" >"$PARTS/gguf.part2"
    sha256sum "$source" | cut -d' ' -f1 >"$PARTS/gguf.sha256"
    ls -l "$PARTS/gguf.part1" "$PARTS/gguf.part2" >&2
    ;;
  stash)
    mkdir -p "$GGUF_DIR"
    cp "$PARTS/gguf.part1" "$GGUF_DIR/part1"
    echo "gguf_parts.sh: part 1 kept in $GGUF_DIR ($(stat -c %s "$GGUF_DIR/part1") bytes)" >&2
    ;;
  join)
    [ -f "$GGUF_DIR/part1" ] || { echo "gguf_parts.sh: no part 1 in $GGUF_DIR (run stash in a call before)" >&2; exit 1; }
    cat "$GGUF_DIR/part1" "$PARTS/gguf.part2" >"$GGUF_DIR/smollm2.gguf"
    [ "$(sha256sum "$GGUF_DIR/smollm2.gguf" | cut -d' ' -f1)" = "$(cat "$PARTS/gguf.sha256")" ] \
      || { echo "gguf_parts.sh: the joined file's SHA-256 differs from the original's" >&2; exit 1; }
    echo "$GGUF_DIR/smollm2.gguf"
    ;;
  *) echo "usage: benchmarks/gguf_parts.sh split|stash|join" >&2; exit 2 ;;
esac

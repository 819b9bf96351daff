#!/usr/bin/env bash
# One entry point for a fresh machine: set up .venv (core + every plugin), then run or test.
#   bash scripts/dev.sh run  [jackfield run arguments...]
#   bash scripts/dev.sh test [pytest arguments...]   ruff check, then pytest on 2 workers (-n 0: one)
# JACKFIELD_TORCH overrides the torch requirement installed first (default: the local CPU wheel
# pin below; the packages themselves accept any torch>=2.4).
set -euo pipefail
cd "$(dirname "$0")/.."
cmd="${1:-run}"
shift || true

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "${JACKFIELD_TORCH:-torch==2.13.0}"
editables=(-e "core[test,triton,serve]")
for plugin in plugins/*/; do
    [ -f "$plugin/pyproject.toml" ] && editables+=(-e "$plugin")
done
"${pip[@]}" "${editables[@]}"

case "$cmd" in
    run) exec .venv/bin/jackfield run "$@" ;;
    test)
        .venv/bin/ruff check .
        # Two workers (pytest-xdist): CI's machine has 2 cores; a later -n in "$@" overrides.
        exec .venv/bin/python -m pytest -n 2 "$@" ;;
    *) echo "usage: scripts/dev.sh run|test [args...]" >&2; exit 2 ;;
esac

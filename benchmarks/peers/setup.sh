#!/usr/bin/env bash
# Creates one virtual environment per benchmark peer under .bench/ (gitignored).
# Never touches .venv: `make test` does not need any of this.
#
#   bash benchmarks/peers/setup.sh            # all peers
#   bash benchmarks/peers/setup.sh dbos       # only the named ones
#
# A venv that finished installing has a .installed stamp and is skipped next time;
# delete the venv folder to rebuild it. One failing peer does not stop the others:
# the driver shows it as "not installed".
set -u
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BENCH="$ROOT/.bench"
PY="${PY:-python3.11}"
mkdir -p "$BENCH"

declare -A PKGS=(
  # ratchet's own side: the repo (editable) and the profilers.
  [ratchet]="-e $ROOT pyinstrument py-spy"
  [asyncio]=""  # the standard library only
  [langgraph]="langgraph>=1.2,<2 langgraph-checkpoint-sqlite>=3,<4"
  [dbos]="dbos>=3.4,<4"
  # Only 0.2.0 has a ready-built wheel; it needs PyFlink 2.2.x (about 1.7 GB, ~90 s).
  [flink-agents]="flink-agents==0.2.0 apache-flink==2.2.1"
  [pyflink]="apache-flink==2.3.0"
  # ratchet's Flink engine: the repo (editable) with PyFlink 2.3.0 (its flink extra).
  [ratchet-flink]="-e $ROOT apache-flink==2.3.0"
)
ORDER=(ratchet asyncio langgraph dbos flink-agents pyflink ratchet-flink)
if [ $# -gt 0 ]; then ORDER=("$@"); fi

# pip, without the index's "Location ... is ignored" noise; returns pip's own status.
pip_q() {
  "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory"
  return "${PIPESTATUS[0]}"
}

status=0
for name in "${ORDER[@]}"; do
  venv="$BENCH/$name"
  if [ -f "$venv/.installed" ]; then echo "[$name] ready ($venv)"; continue; fi
  echo "[$name] creating $venv"
  start=$(date +%s)
  rm -rf "$venv"
  if "$PY" -m venv "$venv" \
     && pip_q "$venv/bin/python" -m pip install -q --upgrade pip \
     && { [ -z "${PKGS[$name]}" ] || pip_q "$venv/bin/python" -m pip install -q ${PKGS[$name]}; }; then
    touch "$venv/.installed"
    echo "[$name] installed in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)"
  else
    echo "[$name] FAILED (the driver will show it as not installed)"
    status=1
  fi
done
exit $status

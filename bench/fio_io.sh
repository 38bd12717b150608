#!/usr/bin/env bash
# fio and `expertfs bench io` side by side on one file (see bench/fio_io_compare.py).
# Installs fio when missing (Debian/Ubuntu, as root). Usage:
#   bash bench/fio_io.sh [--file F | --file-size 1G] [--bs 4M] [--qd 1,4,16,32] [--total 512M] [--json OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v fio >/dev/null 2>&1; then
  echo "installing fio" >&2
  (apt-get install -y fio >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y fio >/dev/null; })
fi
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" bench/fio_io_compare.py "$@"

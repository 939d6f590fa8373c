#!/usr/bin/env bash
# Install what the tests need, then run the whole test suite. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
echo "==> ruff"
.venv/bin/ruff check tpufab tests tasks.py bench
echo "==> pytest"
exec .venv/bin/python -m pytest -q -ra "$@"

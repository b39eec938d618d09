#!/usr/bin/env bash
# One command for both linters over tracked files: ruff (Python) and clang-format (C++).
# Usage: scripts/lint.sh [--fix]
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
if [[ "${1:-}" == "--fix" ]]; then
  ruff check --fix . && ruff format .
  git ls-files 'csrc/*.cpp' 'csrc/*.h' | xargs -r clang-format -i
else
  ruff check .
  ruff format --check .
  git ls-files 'csrc/*.cpp' 'csrc/*.h' | xargs -r clang-format --dry-run --Werror
fi

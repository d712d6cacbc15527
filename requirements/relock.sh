#!/usr/bin/env bash
# Rewrite requirements/lock.txt: a fresh Python 3.11 venv installs opct[dev] through the current lock (pass --newest
# to drop it: every package moves to the newest release pyproject.toml's ranges allow), then its pip freeze
# (torch's local "+cpu" label dropped, so the lock also installs from PyPI). Check the demo's figures afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
v=$(mktemp -d)
trap 'rm -rf "$v"' EXIT
python3.11 -m venv "$v"
lock=(-c requirements/lock.txt)
[ "${1:-}" = --newest ] && lock=()
"$v/bin/pip" install -q --disable-pip-version-check "${lock[@]}" -e ".[dev]"
{ sed -n '/^#/p' requirements/lock.txt; "$v/bin/pip" freeze --exclude-editable | sed 's/+cpu$//'; } > "$v/lock.txt"
mv "$v/lock.txt" requirements/lock.txt

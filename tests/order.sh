#!/usr/bin/env bash
# `make test-order`: each test file of make test's selection alone, a fresh process each, then all of them in one
# process in reverse order; a test that passes only after another (state an earlier test left) fails here.
# usage: bash tests/order.sh PYTHON [PATH...]   (default: tests; the files of PATH that hold tests not slow, not compat)
set -uo pipefail
python=$1
shift
pytest=("$python" -m pytest -q -p no:cacheprovider -m "not slow and not compat")
files=$("${pytest[@]}" --collect-only "${@:-tests}" | sed -n 's/::.*//p' | sort -u)
[ -n "$files" ] || { echo "no tests in ${*:-tests}" >&2; exit 2; }
failed=()
for file in $files; do
    echo "--- $file, alone"
    "${pytest[@]}" "$file" || failed+=("$file alone")
done
echo "--- every file, in reverse order"
# shellcheck disable=SC2046
"${pytest[@]}" $(sort -r <<<"$files") || failed+=("the files in reverse order")
if [ ${#failed[@]} -gt 0 ]; then
    printf 'failed: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "every file passed alone and in reverse order"

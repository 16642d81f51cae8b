#!/usr/bin/env bash
# Run the test suite (CPU; multi-process tests use torchrun with gloo). Extra flags go to pytest.
source "$(dirname "$0")/env.sh"
set +e
"$PY" -m pytest "$@"
status=$?
# pytest exits 5 when it collected nothing: that is a failure, never a pass.
if [ "$status" -eq 5 ]; then
    echo "no tests were collected: treating the run as failed" >&2
    exit 1
fi
exit "$status"

# Sourced by the other scripts: make sure ./.venv holds titanlite and its dependencies.
#
# First use creates .venv. It sees the system's packages, so an installed torch (a CUDA build on
# a GPU image, say) is used as it is and never replaced; only when no torch is importable at all
# is the CPU-friendly torch==2.13.0 installed. Later uses only re-install when pyproject.toml changed.
set -euo pipefail
TITANLITE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$TITANLITE_ROOT/.venv"
PY="$VENV/bin/python"
stamp="$VENV/.titanlite-installed"
want="$(sha256sum "$TITANLITE_ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setting up $VENV (first use only) ..." >&2
    [ -x "$PY" ] || python3 -m venv --system-site-packages "$VENV"
    if ! "$PY" -c "import torch" 2>/dev/null; then
        "$PY" -m pip install -q "torch==2.13.0"
    fi
    "$PY" -m pip install -q -e "$TITANLITE_ROOT[dev]"
    echo "$want" > "$stamp"
fi
cd "$TITANLITE_ROOT"

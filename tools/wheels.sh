# Sourced by the device scripts: the serve and structured extras' wheels (carry [".whl"]: the device image
# lacks FastAPI/uvicorn/pydantic and xgrammar/apache-tvm-ffi). The image's python is a venv, which ignores
# `pip install --user`, so they go to a target added to PYTHONPATH.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /dev/null 2>&1 && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site || echo "wheels.sh: the .whl install failed"
fi

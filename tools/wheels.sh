# Sourced by the device scripts: the serve and structured extras' wheels (carry [".whl"]: the device image
# lacks FastAPI/uvicorn/pydantic and xgrammar/apache-tvm-ffi). The image's python is a venv, which ignores
# `pip install --user`, so they go to a target added to PYTHONPATH. Made on the development machine with
# `pip download --no-deps --python-version 3.12 --only-binary :all: -d .whl -c constraints.txt fastapi
# starlette annotated-doc opentelemetry-api uvicorn h11 httptools anyio sniffio pydantic pydantic-core
# annotated-types typing-inspection prometheus-client openai httpx httpcore httpx2 httpcore2 truststore
# distro jiter xgrammar apache-tvm-ffi` (a dependency missing here makes the server's GPU tests skip:
# fastapi 0.165 imports opentelemetry, openai 3.60 imports httpx2). The rest they need (click, idna,
# certifi, typing-extensions) the image had when the server ran there (docs/performance.md v31, v42).
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /dev/null 2>&1 && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site || echo "wheels.sh: the .whl install failed"
fi

"""The OpenAI-compatible HTTP server (``pagedflash serve``), a thin layer over the engine's step API.

- :mod:`.api_server`: the FastAPI app, the command line and uvicorn (TCP_NODELAY, SIGTERM drain);
- :mod:`.serving`: request validation and the generation of one HTTP request;
- :mod:`.responses`: the response bodies and stream chunks, logprobs formats;
- :mod:`.engine_loop`: the one thread that owns the ``LLM`` and runs its steps;
- :mod:`.protocol`: typed request and response bodies;
- :mod:`.tokenizer`: tokenizer, chat template, incremental detokenization and stop strings;
- :mod:`.tokenize`: vLLM's ``/tokenize`` and ``/detokenize``;
- :mod:`.metrics`: the Prometheus metrics.

Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client, jinja2).
"""

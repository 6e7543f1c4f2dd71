"""The benchmark suite behind ``python -m pagedflash bench <name>``.

``common`` holds the shared plumbing (timing, SDPA baselines, checks, results, tables, plots); each of
``prefill``, ``decode``, ``paged`` and ``overhead`` is one benchmark with a ``main(cfg) -> exit code``.
"""

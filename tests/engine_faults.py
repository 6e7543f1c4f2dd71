"""Faults injected into an engine process (``pagedflash serve --engine-process``) from a test.

:class:`FailingSteps` travels to the child inside the server's parsed options (the ``args`` the
child unpickles); unpickling it there makes :meth:`pagedflash.engine.LLM.step` raise
:class:`~pagedflash.engine.WorkerError` from its ``after + 1``-th call on, as a closed
tensor-parallel engine does once a rank died.
"""

from __future__ import annotations


class FailingSteps:
    def __init__(self, after: int):
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ValueError(f"after must be an int >= 0, got {after!r}")
        self.after = after

    def __reduce__(self):
        return (_install, (self.after,))


def _install(after: int) -> FailingSteps:
    """In the unpickling process: LLM.step fails from call ``after + 1`` on."""
    from pagedflash.engine.llm import LLM
    from pagedflash.engine.workers import WorkerError

    step, calls = LLM.step, [0]

    def failing_step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] > after:
            raise WorkerError("injected: tensor-parallel rank 1 died")
        return step(self, *args, **kwargs)

    LLM.step = failing_step
    return FailingSteps(after)

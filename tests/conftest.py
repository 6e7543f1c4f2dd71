"""Fixtures shared by every test (helpers that tests import are in helpers.py).

- ``pagedflash`` is imported first: it switches Triton to the CPU interpreter when there is no GPU,
  which must happen before anything imports triton.
- Triton's interpreter skips re-patching the language on each jit-helper call inside a kernel
  (:func:`pagedflash.testing.skip_repeated_interpreter_patching`) and the integer overflow checks it
  computes but never asserts (:func:`pagedflash.testing.skip_interpreter_overflow_checks`): the same
  results, faster.
- Every ``torch.empty``/``empty_like`` made during a test is poisoned (NaN for floats, a huge value
  for ints), so an output element a kernel forgot to write fails the comparison.
"""

import pagedflash  # noqa: F401  (first: sets TRITON_INTERPRET on CPU-only machines)
import pytest
import torch
import torch.utils._device as _torch_device

from pagedflash.testing import skip_interpreter_overflow_checks, skip_repeated_interpreter_patching

_real_empty, _real_empty_like = torch.empty, torch.empty_like
# torch.device(...) as a context manager recognizes factory functions from a set it builds once; build
# it now, from the real functions, so that poisoning (which swaps torch.empty) cannot hide them from it.
_torch_device._device_constructors()
skip_repeated_interpreter_patching()  # interpreted kernels' helper calls: ~25 % of an engine test's time
skip_interpreter_overflow_checks()  # checks the interpreter computes and drops: ~29 % of an engine test's time


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype in (torch.int32, torch.int64):
        t.fill_(2**30)
    return t


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(_real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(_real_empty_like(*a, **k)))

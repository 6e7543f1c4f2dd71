"""Shared test setup.

- ``pagedflash`` is imported first: it switches Triton to the CPU interpreter when there is no GPU,
  which must happen before anything imports triton.
- Every ``torch.empty``/``empty_like`` made during a test is poisoned (NaN for floats, a huge value
  for ints), so an output element a kernel forgot to write fails the comparison.
- ``ON_GPU`` selects the matrix: small and fp32/fp16 under the interpreter, full with bf16 and long
  sequences when compiled on a GPU.
"""

import pagedflash  # noqa: F401  (first: sets TRITON_INTERPRET on CPU-only machines)
import pytest
import torch
import torch.utils._device as _torch_device

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
# (dtype, atol, rtol) against the fp32 reference; randn inputs give outputs of order 1.
TOLERANCES = {torch.float32: (2e-4, 2e-4), torch.float16: (6e-3, 6e-3), torch.bfloat16: (4e-2, 4e-2)}
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]

_real_empty, _real_empty_like = torch.empty, torch.empty_like
# torch.device(...) as a context manager recognizes factory functions from a set it builds once; build
# it now, from the real functions, so that poisoning (which swaps torch.empty) cannot hide them from it.
_torch_device._device_constructors()


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


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str = "out") -> None:
    """Compare to the fp32 reference with the dtype's tolerance; show the worst elements on failure."""
    atol, rtol = TOLERANCES[dtype]
    a, e = actual.float(), expected.float()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != reference {tuple(e.shape)}"
    both_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = torch.where(both_inf, torch.zeros_like(a), (a - e).abs())
    diff = torch.where(torch.isnan(a) | torch.isnan(e), torch.full_like(a, float("inf")), diff)
    bad = diff > atol + rtol * torch.where(torch.isinf(e), torch.zeros_like(e), e.abs())
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        rows = "; ".join(f"{tuple(i)}: got {a[tuple(i)].item():.6g}, want {e[tuple(i)].item():.6g}" for i in idx)
        raise AssertionError(f"{name}: {int(bad.sum())}/{bad.numel()} elements off (max diff "
                             f"{diff.max().item():.3g}, atol {atol}, rtol {rtol}); first: {rows}")


def randn(*shape, dtype=torch.float32, generator=None):
    return torch.randn(*shape, generator=generator, dtype=torch.float32, device=DEVICE).to(dtype)


def cu_seqlens(lengths) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEVICE)


def ids(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return str(value)

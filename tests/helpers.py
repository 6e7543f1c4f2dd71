"""What test files share (fixtures stay in conftest.py): the device and dtypes of the matrix, the
tolerance rule, random inputs, cu_seqlens and page pools on the test device, parametrize ids.

``ON_GPU`` selects the matrix: small and fp32/fp16 under the interpreter, full with bf16 and long
sequences when compiled on a GPU. The comparison rule and the pool builder are the package's
(:mod:`pagedflash.testing`), shared with the benchmarks and ``pagedflash demo``.
"""

import pagedflash  # noqa: F401, I001  (first: sets TRITON_INTERPRET on CPU-only machines)
import torch

from pagedflash.cache import cu_seqlens_tensor
from pagedflash.testing import assert_close, random_paged_kv

__all__ = ["DEVICE", "DTYPES", "ON_GPU", "assert_close", "cu_seqlens", "fp8_pool", "ids", "make_pool", "randn"]

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]


def randn(*shape, dtype=torch.float32, generator=None) -> torch.Tensor:
    """Normal values on the test device, drawn in fp32 (the same draws whatever the dtype)."""
    return torch.randn(*shape, generator=generator, dtype=torch.float32, device=DEVICE).to(dtype)


def cu_seqlens(lengths) -> torch.Tensor:
    """:func:`pagedflash.cache.cu_seqlens_tensor` on the test device."""
    return cu_seqlens_tensor(lengths, device=DEVICE)


def make_pool(seqlens, page, hkv, d, dtype, *, share_first=0, spare=3):
    """:func:`pagedflash.testing.random_paged_kv` on the test device: a NaN-poisoned pool ``spare`` x
    larger than needed, block tables a random permutation of it; ``share_first`` > 0 makes every
    sequence alias the first sequence's first pages (prefix caching)."""
    return random_paged_kv(seqlens, page, hkv, d, dtype, device=DEVICE, spare=spare, share_first=share_first)


def fp8_pool(seqlens, page, hkv, d, fp8=torch.float8_e4m3fn, **kwargs):
    """:func:`make_pool` stored in fp8 (NaN in every unused slot); built in fp32 and converted, so no
    fp8 scatter is needed on the device."""
    k_cache, v_cache, table = make_pool(seqlens, page, hkv, d, torch.float32, **kwargs)
    return k_cache.to(fp8), v_cache.to(fp8), table


def ids(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return str(value)


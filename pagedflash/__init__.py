"""pagedflash: inference attention kernels in portable Triton.

flash-attn-compatible entry points (switch by changing the import):

- :func:`flash_attn_func`         dense prefill,            q ``[B, Sq, Hq, D]``
- :func:`flash_attn_varlen_func`  packed variable lengths,  q ``[total_q, Hq, D]``; with
  ``block_table`` the keys/values come from a paged cache (chunked prefill, mixed batches)
- :func:`flash_attn_with_kvcache` decode against a contiguous or paged KV cache (split-KV)
- :func:`merge_attn_states`       merge two partial attention states by their log-sum-exp
- :func:`write_kv_cache`          scatter new keys/values into a paged cache by slot
- :func:`batch_invariant`         the batch-invariant mode (:mod:`pagedflash.batch_invariance`) as a
  context manager; :func:`set_batch_invariant` sets it process-wide

Code that calls flash-attn 2 positionally, or with its packed variants, rotary embedding or
``cache_batch_idx``, imports :mod:`pagedflash.flash_attn_interface` instead: flash-attn's exact
signatures over the same kernels.

Dimension names used in every docstring: ``B`` batch, ``Sq``/``Sk`` query/key lengths, ``Hq``/``Hkv``
query/key-value heads, ``G = Hq // Hkv``, ``D`` head dim. LSE is the natural-log log-sum-exp, fp32.
"""

from pagedflash import _env  # noqa: F401  (must run before triton is imported)
from pagedflash.batch_invariance import batch_invariant, is_batch_invariant, set_batch_invariant
from pagedflash.ops.cache_write import write_kv_cache
from pagedflash.ops.combine import merge_attn_states
from pagedflash.ops.decode import flash_attn_with_kvcache
from pagedflash.ops.prefill import flash_attn_func, flash_attn_varlen_func

__all__ = [
    "batch_invariant",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "is_batch_invariant",
    "merge_attn_states",
    "set_batch_invariant",
    "write_kv_cache",
]
__version__ = "0.1.0"

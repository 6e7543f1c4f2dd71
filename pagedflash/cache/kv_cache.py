"""The tensor side of the paged KV cache: per-layer page pools and the int metadata kernels take.

Layout (flash-attn's paged layout), one pool per layer for keys and one for values::

    k_cache, v_cache: [num_blocks, page_size, Hkv, D]

Token ``i`` of a sequence with block table ``table`` lives in page ``table[i // page_size]`` at
offset ``i % page_size``, i.e. at the flat *slot* ``table[i // page_size] * page_size + i % page_size``
of the pool viewed as ``[num_blocks * page_size, Hkv, D]``.

An fp8 pool (``dtype=torch.float8_e4m3fn`` or ``float8_e5m2``) holds twice the tokens of a 16-bit
one in the same bytes; each layer has a key scale and a value scale (fp32, 1.0 unless given), one
per tensor or one per KV head of the pool: writes store ``k / k_scale`` (``write_kv_cache(...,
k_scale=)``), attention multiplies it back (``k_descale=``). :meth:`KVCache.scales` gives a layer's
pair.

Metadata produced here: block tables ``int32 [B, max_blocks]`` padded with :data:`PAD_BLOCK_ID`,
slot mappings ``int64 [T]``, sequence lengths ``int32 [B]`` and ``cu_seqlens`` ``int32 [B + 1]``.
Block tables come from :class:`pagedflash.cache.BlockManager`; this module never imports the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedflash.validate import FP8_DTYPES, check_int

__all__ = [
    "PAD_BLOCK_ID",
    "KVCache",
    "block_table_tensor",
    "cu_seqlens_tensor",
    "seqlens_tensor",
    "slot_mapping",
    "slot_mapping_tensor",
]

PAD_BLOCK_ID = 0
"""Fills block-table rows past a sequence's last page. A valid page id, so even an unmasked read of
padding stays inside the pool; correct kernels never use it (they stop at the sequence length)."""

_KV = 2  # one pool for keys, one for values


class KVCache:
    """Per-layer K/V page pools, one contiguous allocation ``[num_layers, 2, num_blocks, page_size, Hkv, D]``.

    Args (keyword-only):
        num_layers, num_blocks, page_size, num_kv_heads, head_dim: pool sizes (each >= 1).
        dtype, device: of the pools (fp16, bf16, fp32, or fp8: ``float8_e4m3fn``/``float8_e5m2``).
        poison: fill the pools with NaN instead of zeros (tests: slots a kernel must not read).
        k_scale, v_scale: fp8 pools only: the scale of each layer's keys / values (default 1.0):
            one float for every layer, or ``num_layers`` entries (as calibrated checkpoints give
            them), each a float (per tensor) or ``num_kv_heads`` floats (per KV head of this pool);
            a tensor ``[num_layers]`` or ``[num_layers, num_kv_heads]`` as well.

    ``cache.k_cache(layer)`` / ``cache.v_cache(layer)`` are contiguous views
    ``[num_blocks, page_size, Hkv, D]``; ``cache[layer]`` gives ``(k_cache, v_cache)`` and
    ``cache.scales(layer)`` that layer's ``(k_scale, v_scale)`` (fp32 ``[1]`` or ``[Hkv]``; None, None
    unless fp8).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        poison: bool = False,
        k_scale=None,
        v_scale=None,
    ):
        for name, value in [
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ]:
            check_int(name, value)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, _KV, num_blocks, page_size, num_kv_heads, head_dim)
        if poison:
            self.kv = torch.full(shape, float("nan"), dtype=dtype, device=device)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        # scales of an fp8 pool, fp32 [num_layers, 1] (per tensor) or [num_layers, Hkv] (None for other dtypes)
        self.k_scales = self.v_scales = None
        if dtype in FP8_DTYPES:
            self.k_scales = layer_scales("k_scale", k_scale, num_layers, num_kv_heads, self.kv.device)
            self.v_scales = layer_scales("v_scale", v_scale, num_layers, num_kv_heads, self.kv.device)
        elif k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale, v_scale: scales apply to fp8 pools only (dtype is {dtype}), expected None")

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def nbytes(self) -> int:
        """Bytes held by all pools."""
        return self.kv.numel() * self.kv.element_size()

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)`` of one layer, each ``[num_blocks, page_size, Hkv, D]``."""
        return self.k_cache(layer), self.v_cache(layer)

    def k_cache(self, layer: int) -> torch.Tensor:
        """Key pool of ``layer``: ``[num_blocks, page_size, Hkv, D]``, a view of :attr:`kv`."""
        return self.kv[self._check_layer(layer), 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """Value pool of ``layer``: ``[num_blocks, page_size, Hkv, D]``, a view of :attr:`kv`."""
        return self.kv[self._check_layer(layer), 1]

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_scale, v_scale)`` of ``layer``, fp32 ``[1]`` or ``[Hkv]`` views (what ``write_kv_cache``
        takes as ``k_scale``/``v_scale`` and attention as ``k_descale``/``v_descale``); None, None
        unless fp8."""
        layer = self._check_layer(layer)
        if self.k_scales is None:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]

    def _check_layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return layer

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes over all layers, keys and values together."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * _KV * page_size * num_kv_heads * head_dim * itemsize

    @staticmethod
    def num_blocks_for_memory(
        num_bytes: int,
        *,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many blocks fit in ``num_bytes`` (may be 0: the caller decides whether that is an error)."""
        check_int("num_bytes", num_bytes, minimum=0)
        per_block = KVCache.bytes_per_block(
            num_layers=num_layers,
            page_size=page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
        )
        return num_bytes // per_block


def layer_scales(name: str, value, num_layers: int, num_kv_heads: int, device) -> torch.Tensor:
    """K or V scales of a pool as fp32 ``[num_layers, 1]`` (one per tensor) or ``[num_layers, Hkv]``
    (one per KV head, when any layer gives one per head; the others then repeat theirs), from one
    float for every layer or ``num_layers`` entries, each a float or ``num_kv_heads`` floats (a
    tensor ``[num_layers]``/``[num_layers, Hkv]`` too); each finite and > 0."""
    expected = f"a float or {num_layers} entries (one per layer), each a float or {num_kv_heads} floats (per KV head)"
    if value is None:
        value = 1.0
    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu().tolist()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * num_layers
    try:
        rows = [[float(x)] if isinstance(x, (int, float)) and not isinstance(x, bool) else [float(y) for y in x]
                for x in value]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {expected}, got {value!r}") from None
    if len(rows) != num_layers or any(len(r) not in (1, num_kv_heads) for r in rows):
        raise ValueError(f"{name} must be {expected}, got {[len(r) for r in rows]} values per layer for "
                         f"{len(rows)} layers")
    width = max(len(r) for r in rows)
    rows = [r * width if len(r) == 1 else r for r in rows]
    if not all(0.0 < x < float("inf") for r in rows for x in r):
        raise ValueError(f"{name} must be finite and > 0, got {rows}")
    return torch.tensor(rows, dtype=torch.float32, device=device)


def block_table_tensor(
    block_tables: Sequence[Sequence[int]], *, device: torch.device | str, max_blocks: int | None = None
) -> torch.Tensor:
    """Pack Python block tables into ``int32 [B, max_blocks]``, rows padded with :data:`PAD_BLOCK_ID`.

    ``max_blocks`` defaults to the longest table; a smaller value raises ``ValueError``.
    """
    longest = max((len(t) for t in block_tables), default=0)
    if max_blocks is None:
        max_blocks = longest
    elif max_blocks < longest:
        raise ValueError(f"max_blocks must be at least the longest block table ({longest}), got {max_blocks}")
    rows = [list(t) + [PAD_BLOCK_ID] * (max_blocks - len(t)) for t in block_tables]
    out = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), max_blocks)
    return out.to(device)


def slot_mapping(block_table: Sequence[int], start: int, end: int, *, page_size: int) -> list[int]:
    """Slots of token positions ``start .. end - 1`` of one sequence: ``table[i // p] * p + i % p``."""
    check_int("page_size", page_size)
    capacity = len(block_table) * page_size
    if not 0 <= start <= end <= capacity:
        raise ValueError(
            f"need 0 <= start <= end <= len(block_table) * page_size = {capacity}, got start={start}, end={end}"
        )
    return [block_table[i // page_size] * page_size + i % page_size for i in range(start, end)]


def slot_mapping_tensor(
    block_tables: Sequence[Sequence[int]],
    starts: Sequence[int],
    ends: Sequence[int],
    *,
    page_size: int,
    device: torch.device | str,
) -> torch.Tensor:
    """Slots of positions ``starts[b] .. ends[b] - 1`` of every sequence ``b``, concatenated: ``int64 [T]``."""
    if not len(block_tables) == len(starts) == len(ends):
        raise ValueError(
            f"block_tables, starts and ends must have one entry per sequence, got lengths "
            f"{len(block_tables)}, {len(starts)}, {len(ends)}"
        )
    slots: list[int] = []
    for table, start, end in zip(block_tables, starts, ends):
        slots += slot_mapping(table, start, end, page_size=page_size)
    return torch.tensor(slots, dtype=torch.int64, device=device)


def seqlens_tensor(seqlens: Sequence[int], *, device: torch.device | str) -> torch.Tensor:
    """Sequence lengths as ``int32 [B]``."""
    return torch.tensor(list(seqlens), dtype=torch.int32, device=device)


def cu_seqlens_tensor(seqlens: Sequence[int], *, device: torch.device | str) -> torch.Tensor:
    """Cumulative lengths with a leading 0, ``int32 [B + 1]``: sequence ``b`` is rows ``cu[b]:cu[b+1]``.
    The one builder of ``cu_seqlens`` in the package, the benchmarks and the tests."""
    seqlens = list(seqlens)
    if any(n < 0 for n in seqlens):
        raise ValueError(f"seqlens must be non-negative, got {list(seqlens)}")
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)

"""The tensor side of the paged KV cache: per-layer page pools and the int metadata kernels take.

Layout (flash-attn's paged layout), one pool per layer for keys and one for values::

    k_cache, v_cache: [num_blocks, page_size, Hkv, D]

Token ``i`` of a sequence with block table ``table`` lives in page ``table[i // page_size]`` at
offset ``i % page_size``, i.e. at the flat *slot* ``table[i // page_size] * page_size + i % page_size``
of the pool viewed as ``[num_blocks * page_size, Hkv, D]``.

Metadata produced here: block tables ``int32 [B, max_blocks]`` padded with :data:`PAD_BLOCK_ID`,
slot mappings ``int64 [T]``, sequence lengths ``int32 [B]`` and ``cu_seqlens`` ``int32 [B + 1]``.
Block tables come from :class:`pagedflash.cache.BlockManager`; this module never imports the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedflash.validate import check_int

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
        dtype, device: of the pools.
        poison: fill the pools with NaN instead of zeros (tests: slots a kernel must not read).

    ``cache.k_cache(layer)`` / ``cache.v_cache(layer)`` are contiguous views
    ``[num_blocks, page_size, Hkv, D]``; ``cache[layer]`` gives ``(k_cache, v_cache)``.
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

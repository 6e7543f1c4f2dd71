"""Paged KV cache: the pure-Python block manager and the tensor pools with their metadata helpers."""

from pagedflash.cache.block_manager import BlockManager, NoFreeBlocksError, PrefixCacheStats, chain_hash
from pagedflash.cache.kv_cache import (
    PAD_BLOCK_ID,
    KVCache,
    block_table_tensor,
    cu_seqlens_tensor,
    seqlens_tensor,
    slot_mapping,
    slot_mapping_tensor,
)

__all__ = [
    "PAD_BLOCK_ID",
    "BlockManager",
    "KVCache",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "block_table_tensor",
    "chain_hash",
    "cu_seqlens_tensor",
    "seqlens_tensor",
    "slot_mapping",
    "slot_mapping_tensor",
]

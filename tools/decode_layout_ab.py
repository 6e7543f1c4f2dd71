"""Does flash-attn's token-major cache layout cost decode bandwidth? (fifth session, v14)

SDPA's contiguous [B, Hkv, N, D] copies stream each (row, head) as one contiguous run; the
[B, N, Hkv, D] cache reads one 2*D-byte row per key, Hkv rows apart. Per cell, in the bench's timing
method (graph replay, L2 zeroed before each call), this times:
  - pagedflash on the token-major cache and on head-major memory (a strided [B, N, Hkv, D] view);
  - SDPA cuDNN on contiguous head-major copies (what `bench decode` times) and on the strided view
    of the token-major cache (what a user of the flash-attn layout would pass).
    python tools/decode_layout_ab.py
"""
import functools
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedflash import flash_attn_with_kvcache, validate
from pagedflash.bench.tune import _time_us

CELLS = [(1, 16384), (1, 131072), (4, 65536), (16, 1024), (16, 65536), (64, 1024), (64, 16384), (64, 65536)]
HQ, HKV, D = 32, 8, 128


def main() -> None:
    validate.value_checks(False).__enter__()
    for b, n in CELLS:
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(b, n, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kh, vh = (x.transpose(1, 2).contiguous() for x in (kc, vc))  # [B, Hkv, N, D] memory
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        want = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens).float()
        got = flash_attn_with_kvcache(q, kh.transpose(1, 2), vh.transpose(1, 2), cache_seqlens=lens).float()
        row = dict(b=b, n=n, err=(got - want).abs().max().item())
        row["pf_token_major"] = _time_us(functools.partial(flash_attn_with_kvcache, q, kc, vc, cache_seqlens=lens))
        row["pf_head_major"] = _time_us(functools.partial(flash_attn_with_kvcache, q, kh.transpose(1, 2),
                                                          vh.transpose(1, 2), cache_seqlens=lens))
        qt = q.transpose(1, 2).contiguous()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn_head_major"] = _time_us(functools.partial(F.scaled_dot_product_attention, qt, kh, vh,
                                                                 enable_gqa=True))
            row["cudnn_token_major_view"] = _time_us(functools.partial(
                F.scaled_dot_product_attention, qt, kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True))
        print(json.dumps(row), flush=True)
        del q, kc, vc, kh, vh
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

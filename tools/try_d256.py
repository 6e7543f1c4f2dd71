import torch

from pagedflash import reference as ref
from pagedflash.ops.attention import attention_forward
from pagedflash.ops.launch import LaunchConfig

for d in (256, 200, 160):
    q, k, v = (torch.randn(2, 300, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    want = ref.attention_ref(q, k, v, causal=True)[0]
    for bm, bn, w, s in [(64, 32, 4, 2), (64, 32, 4, 1), (64, 32, 8, 2), (32, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2)]:
        try:
            out, _ = attention_forward(q, k, v, batch=2, max_seqlen_q=300, max_seqlen_k=300, sm_scale=d**-0.5,
                                       window=(-1, 0), softcap=0.0, num_splits=1,
                                       config=LaunchConfig(bm, bn, 1, w, s))
            torch.cuda.synchronize()
            print(d, (bm, bn, w, s), "ok", (out.float() - want).abs().max().item())
        except Exception as e:
            print(d, (bm, bn, w, s), type(e).__name__, str(e)[:300])

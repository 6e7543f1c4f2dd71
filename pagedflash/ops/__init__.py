"""Every Triton kernel of pagedflash, one op per module: its ``@triton.jit`` kernel(s) and the host
launcher that checks the inputs, naming the argument. Each has an fp32 reference in
:mod:`pagedflash.reference`.

Attention (the public API, re-exported by :mod:`pagedflash`): ``prefill`` and ``decode`` (entry
points) over ``attention`` (the one attention kernel), ``combine`` (split-KV combine, state merge),
``cache_write`` (K/V into a cache); ``launch`` holds their launch choices, ``_jit`` the shared jit
pieces. ``prefill_hopper_kernel`` is the one Gluon kernel, prefill on sm90 (dense, varlen, paged),
and ``prefill_hopper`` routes the calls where it measured faster to it (the portable kernel
everywhere else).

The decoder's other kernels (used by :mod:`pagedflash.engine`): ``norm`` (RMSNorm with the residual
add), ``rope`` (rotary embedding in place), ``activation`` (SiLU-and-multiply), ``sampling`` (greedy
argmax), ``gemv`` (single-row projections with the norm or SiLU fused in front), ``matmul`` (the
batch-invariant GEMM), ``moe``, ``moe_kernels`` and ``moe_routing`` (the fused mixture-of-experts
layer: its host side and API, its expert GEMM kernels, its routing and grouping).

``utils``: host helpers every launcher shares (cdiv, next_pow2, SM count, compute capability, the
interpreter flag, operand checks).
"""

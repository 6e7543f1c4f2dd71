"""Compile the Gluon Hopper prefill kernel (pagedflash/ops/prefill_hopper_kernel.py) for sm_90 without a GPU.

Every launch variant the library can make (fp16/bf16 x D 64/128 x causal x LSE x dense, varlen over packed
K/V or over pages of 16, 32, 64, 128 or 384 rows, and fp8 K/V (``varlen:e4m3``, ``page64:e4m3``,
``page128:e5m2``, ...); ``KV`` picks some: ``KV=dense,page64``; ``INVARIANT=1``: the batch-invariant
mode's variants, under the split rule of the environment) goes through
Triton's whole pipeline down to a cubin, with the ptxas of the Triton wheel, and prints shared
memory, registers, spills (``spill_ops``: local-memory loads and stores in the SASS) and whether the
softmax sits between the two wgmma waits of the
steady-state loop (``ex2_between_waits``: 64 exp2 per tile and a few more means the softmax
overlaps the PV wgmma). Needs the Triton the kernel is written for (3.6), not a GPU:

    /path/to/triton-3.6-venv/bin/python tools/gluon_compile_check.py

or, beside a newer Triton (the CPU venv's), that wheel alone ahead of it on the path:

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 KV=page64,page64:e4m3 python tools/gluon_compile_check.py

Exit status 1 if any variant failed to compile (``TRACE=1``: stop at the first, with its whole traceback;
the message alone shows only the kernel's outer call).
"""

import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before pagedflash: the kernels must be defined for the compiler
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from pagedflash.ops import launch, prefill_hopper, prefill_hopper_kernel  # noqa: E402
from pagedflash.testing import cubin_resources  # noqa: E402

INVARIANT = os.environ.get("INVARIANT", "0") == "1"  # the batch-invariant mode's variants instead
KV_LAYOUTS = os.environ.get(
    "KV", "dense,varlen,page16,page32,page64,page128,page384,varlen:e4m3,page16:e4m3,page64:e4m3,page128:e5m2").split(",")


def sass_summary(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout.splitlines()
    usage = [f"{k}:{v}" for k, v in cubin_resources(cubin).items() if k in ("REG", "LOCAL")]
    # spills: local-memory loads and stores in the code (the cubin's LOCAL size misses a warp-specialized
    # partition's spills)
    usage.append(f"spill_ops:{sum(' LDL' in line or ' STL' in line for line in sass)}")
    counts, n = [], None
    for line in sass:
        if "DEPBAR.LE gsb0, 0x1" in line:
            n = 0
        elif "DEPBAR.LE gsb0, 0x0" in line and n is not None:
            counts, n = counts + [n], None
        elif "MUFU.EX2" in line and n is not None:
            n += 1
    return f"{' '.join(usage)} ex2_between_waits={counts}"


def main() -> int:
    print(f"triton {triton.__version__} ({Path(triton.__file__).parent})")
    if prefill_hopper.UNAVAILABLE is not None:
        print(f"the Gluon kernel is unavailable here: {prefill_hopper.UNAVAILABLE}")
        return 1
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = prefill_hopper_kernel.prefill_kernel
    FP8 = {"e4m3": (torch.float8_e4m3fn, "fp8e4nv"), "e5m2": (torch.float8_e5m2, "fp8e5")}  # noqa: N806
    missing = [a for a in prefill_hopper_kernel.INT_ARGS if a not in kernel.arg_names]
    if missing:
        print(f"INT_ARGS names no argument of the kernel: {missing}")
        return 1
    failed = 0
    for dtype, short in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        for d in sorted({d for d, _ in prefill_hopper.MIN_SEQLEN}):
            for causal in (False, True):
                for write_lse in (False, True):
                    for kv in KV_LAYOUTS:
                        kv, _, fp8 = kv.partition(":")
                        varlen, page = kv != "dense", int(kv[4:]) if kv.startswith("page") else 0
                        tag = f"{short} D={d} causal={int(causal)} lse={int(write_lse)} {kv}{' ' + fp8 if fp8 else ''}"
                        consts, options, q_block, kv_block, q_layout, kv_layout = prefill_hopper_kernel.kernel_config(
                            d, causal, write_lse, dtype, varlen, page, FP8[fp8][0] if fp8 else None,
                            launch.invariant_split_rule(False, d) if INVARIANT else None)
                        kv_short = FP8[fp8][1] if fp8 else short
                        kv_desc = f"tensordesc<{kv_short}{kv_block},{kv_layout!r}>"
                        if fp8:  # per-KV-head descales
                            types = dict(KDescale="*fp32", VDescale="*fp32")
                        else:
                            types = {}
                            consts = {**consts, "KDescale": None, "VDescale": None}
                        if page:  # packed q, host descriptors over the caches, the caches, the block table
                            types.update(q_desc=f"*{short}", k_desc=kv_desc, v_desc=kv_desc, Kc=f"*{kv_short}",
                                         Vc=f"*{kv_short}", BlockTable="*i32", CuQ="*i32", CuK="*i32")
                        elif varlen:  # the packed tensors themselves and the cu_seqlens
                            types.update(q_desc=f"*{short}", k_desc=f"*{kv_short}", v_desc=f"*{kv_short}",
                                         CuQ="*i32", CuK="*i32")
                            consts = {**consts, "Kc": None, "Vc": None, "BlockTable": None}
                        else:  # host descriptors; no cu_seqlens
                            types.update(q_desc=f"tensordesc<{short}{q_block},{q_layout!r}>", k_desc=kv_desc,
                                         v_desc=kv_desc)
                            consts = {**consts, "CuQ": None, "CuK": None, "Kc": None, "Vc": None, "BlockTable": None}
                        types.update(O=f"*{short}", LSE="*fp32" if write_lse else f"*{short}", qk_scale="fp32")
                        sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in kernel.arg_names}
                        t0 = time.time()
                        try:
                            ck = triton.compile(GluonASTSource(kernel, sig, constexprs=consts),
                                                target=GPUTarget("cuda", 90, 32), options=options)
                        except Exception as e:  # noqa: BLE001 - report every variant
                            failed += 1
                            print(f"{tag}: COMPILE FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
                            if os.environ.get("TRACE") == "1":  # the whole chain, down to the failing line
                                traceback.print_exc()
                                return 1
                            continue
                        nreg = sorted({line.split()[-1].rstrip(";") for line in ck.asm["ptx"].splitlines()
                                       if "setmaxnreg" in line})
                        print(f"{tag}: compiled in {time.time() - t0:.1f} s, smem {ck.metadata.shared} B, "
                              f"scratch {ck.metadata.global_scratch_size} B, warps {ck.metadata.num_warps}, "
                              f"setmaxnreg {nreg}, {sass_summary(ck.asm['cubin'])}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

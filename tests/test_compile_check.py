"""``tools/compile_check.py``: the engine's per-layer kernels compiled for sm_90 without a GPU (a
process of its own: the kernels compiled, not interpreted), at two real shapes, the fused q/k norm
RoPE included: a compile error in a path the interpreter runs fine fails here, not on the GPU."""

import os
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "compile_check.py"


def test_engine_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(TOOL), "--shapes", "qwen3-1.7b,gemma-2-2b"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-1].endswith(" 0 failed")
    for label in ("rope + q/k norm", "rms_norm + residual", "silu_mul_gemv down", "matmul qkv", "argmax"):
        assert any(f" {label} " in x for x in lines), label
    assert all(" 0 B local" in x for x in lines[:-1] if " regs," in x), "a kernel spills"


def test_unknown_shape_is_refused():
    run = subprocess.run([sys.executable, str(TOOL), "--shapes", "nope"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "--shapes: unknown ['nope']" in run.stderr

"""``tools/compile_check.py``: the engine's kernels compiled for sm_90 without a GPU, as an sm90 GPU
plans them (a process of its own: the kernels compiled, not interpreted), at two real shapes (head
dims 128 and 256, Gemma's window and softcap): the per-layer kernels with the fused q/k norm RoPE,
and the attention (paged decode and chunked prefill, bf16 and fp8 pools, the decode graphs' launches,
contiguous decode, dense prefill, merged states, batch-invariant), each specialized by Triton's own
binder. A compile error in a path the interpreter runs fine fails here, not on
the GPU. About a minute of compiling on one core."""

import subprocess
import sys

from helpers import ROOT, child_env

TOOL = ROOT / "tools" / "compile_check.py"


def test_engine_kernels_compile_for_sm90():
    run = subprocess.run([sys.executable, str(TOOL), "--shapes", "qwen3-1.7b,gemma-2-2b"], capture_output=True,
                         text=True, env=child_env(interpret=False), timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-1].endswith(" 0 failed")
    for label in ("rope + q/k norm", "rms_norm + residual", "silu_mul_gemv down", "gelu_tanh_mul",
                  "gelu_tanh_mul_gemv down", "matmul qkv", "argmax",
                  "paged decode 1x1024", "paged chunk fp8 512/4K", "paged decode window", "invariant decode 1x16K",
                  "decode 64x1K", "prefill 2K", "graph decode 1x1024", "matmul down, K chunks", "merge states 512",
                  "matmul qkv, wide tile", "invariant chunk, prefill tile", "invariant graph decode fp8 256x1024"):
        assert any(f" {label} " in x for x in lines), label
    assert all(" 0 B local" in x for x in lines[:-1] if " regs," in x), "a kernel spills"
    for kernel in ("_attention_kernel", "_combine_kernel", "_write_kv_kernel", "_rope_kernel", "_gemv_kernel",
                   "_fold_kernel", "_merge_kernel"):
        assert any(f" {kernel} " in x for x in lines), kernel


def test_moe_layers_compile_for_sm90():
    """The mixture-of-experts shapes' layer kernels, their routing with them (softmax; GPT-OSS's
    topk_softmax with a router bias)."""
    run = subprocess.run([sys.executable, str(TOOL), "--shapes", "qwen3-30b-a3b,gpt-oss-20b", "--parts", "layers"],
                         capture_output=True, text=True, env=child_env(interpret=False), timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[-1].endswith(" 0 failed")
    for shape in ("qwen3-30b-a3b", "gpt-oss-20b"):
        assert any(x.startswith(shape) and " moe route " in x and " _route_kernel " in x for x in lines), shape
    assert all(" 0 B local" in x for x in lines[:-1] if " regs," in x), "a kernel spills"


def test_bad_arguments_are_refused():
    for args, message in ((["--shapes", "nope"], "--shapes: unknown ['nope']"), (["--parts", "kernels"], "--parts:")):
        run = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120,
                             env=child_env())
        assert run.returncode == 2 and message in run.stderr, run.stderr


def test_moe_host_time_runs_on_the_sm90_plans():
    """``tools/moe_host_time.py``, which borrows this tool's sm90 answers: the MoE ops planned and their
    launches recorded (2 for the decode layer, 1 for the route), a time per call printed."""
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "moe_host_time.py"), "--tokens", "1", "--calls", "5"],
                         capture_output=True, text=True, env=child_env(interpret=False), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [x for x in run.stdout.splitlines() if " T=1: " in x]
    assert len(lines) == 2 and all("(2 launches)" in x and "(1 launch)" in x for x in lines), run.stdout

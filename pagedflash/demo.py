"""The kernel part of ``pagedflash demo``: every public kernel once, checked against the reference.

On a GPU the shapes are real (4K prefill, 32K decode, bf16) and each kernel is also timed; on a CPU
they are tiny (fp32 and fp16 under the Triton interpreter) so the table appears in seconds.
:func:`run_kernel_checks` returns the rows; :func:`print_kernel_checks` prints them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import pagedflash as pf
from pagedflash import reference as ref
from pagedflash.bench.common import time_ms
from pagedflash.bench.report import Table, print_table
from pagedflash.cache import cu_seqlens_tensor
from pagedflash.testing import TOLERANCES, check_close, random_paged_kv


@dataclass(frozen=True)
class Sizes:
    batch: int
    seqlen_q: int  # prefill query length
    seqlen_k: int  # prefill key length (> seqlen_q: causal is bottom-right aligned)
    varlen: tuple[int, ...]  # packed sequence lengths
    decode_len: int  # longest cached sequence of the decode checks
    heads: tuple[int, int]  # Hq, Hkv
    dim: int
    page: int
    window: int
    dtype: torch.dtype
    alt_dtype: torch.dtype  # a second dtype, for one prefill case


GPU_SIZES = Sizes(batch=2, seqlen_q=3000, seqlen_k=4096, varlen=(1000, 4096, 17, 3001), decode_len=32768,
                  heads=(32, 8), dim=128, page=16, window=512, dtype=torch.bfloat16, alt_dtype=torch.float16)
CPU_SIZES = Sizes(batch=2, seqlen_q=19, seqlen_k=37, varlen=(5, 23, 1), decode_len=45, heads=(4, 2), dim=32,
                  page=16, window=8, dtype=torch.float32, alt_dtype=torch.float16)


@dataclass
class Check:
    """One kernel call: ``run()`` returns what ``reference()`` is compared with (a tensor or a tuple)."""

    name: str
    shape: str
    dtype: torch.dtype
    run: Callable[[], object]
    reference: Callable[[], object]
    timed: Callable[[], object] | None = None  # what the GPU times, when not ``run``


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _prefill_checks(s: Sizes, dev) -> list[Check]:
    hq, hkv = s.heads
    checks = []
    for name, dtype, sq, kwargs in [
        ("prefill dense", s.dtype, s.seqlen_k, {}),
        ("prefill dense", s.alt_dtype, s.seqlen_k, {}),
        ("prefill causal, Sq < Sk", s.dtype, s.seqlen_q, {"causal": True}),
        ("prefill sliding window", s.dtype, s.seqlen_k, {"causal": True, "window_size": (s.window, 0)}),
        ("prefill softcap", s.dtype, s.seqlen_k, {"softcap": 2.0}),
    ]:
        q = torch.randn(s.batch, sq, hq, s.dim, dtype=dtype, device=dev)
        k, v = (torch.randn(s.batch, s.seqlen_k, hkv, s.dim, dtype=dtype, device=dev) for _ in range(2))
        checks.append(Check(
            f"{name} (+lse)", f"B={s.batch} Sq={sq} Sk={s.seqlen_k} H={hq}/{hkv} D={s.dim}", dtype,
            lambda q=q, k=k, v=v, kw=kwargs: pf.flash_attn_func(q, k, v, return_lse=True, **kw),
            lambda q=q, k=k, v=v, kw=kwargs: ref.attention_ref(q, k, v, **kw)))
    return checks


def _varlen_checks(s: Sizes, dev) -> list[Check]:
    hq, hkv, dtype = *s.heads, s.dtype
    lens = list(s.varlen)
    cu = cu_seqlens_tensor(lens, device=dev)
    q = torch.randn(sum(lens), hq, s.dim, dtype=dtype, device=dev)
    k, v = (torch.randn(sum(lens), hkv, s.dim, dtype=dtype, device=dev) for _ in range(2))
    shape = f"lens={lens} H={hq}/{hkv} D={s.dim}"
    checks = [Check("varlen causal", shape, dtype,
                    lambda: pf.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                                                      max_seqlen_k=max(lens), causal=True),
                    lambda: ref.varlen_attention_ref(q, k, v, cu, cu, causal=True)[0])]
    # chunked prefill: each sequence has cached tokens already in the paged cache, plus new ones
    new = [max(1, n // 4) for n in lens]
    total = [n + m for n, m in zip(lens, new)]
    kc, vc, table = random_paged_kv(total, s.page, hkv, s.dim, dtype, device=dev)
    cu_q, cu_k = cu_seqlens_tensor(new, device=dev), cu_seqlens_tensor(total, device=dev)
    qn = torch.randn(sum(new), hq, s.dim, dtype=dtype, device=dev)
    checks.append(Check(
        "varlen paged (chunked prefill)", f"new={new} cached={lens} page={s.page}", dtype,
        lambda: pf.flash_attn_varlen_func(qn, kc, vc, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(new),
                                          max_seqlen_k=max(total), causal=True, block_table=table),
        lambda: ref.paged_varlen_attention_ref(qn, kc, vc, cu_q, cu_k, table, causal=True)[0]))
    return checks


def _decode_checks(s: Sizes, dev) -> list[Check]:
    hq, hkv, dtype, b, n = *s.heads, s.dtype, s.batch + 2, s.decode_len
    lens = torch.tensor([n, n // 2 + 3, 1, n - 7][:b], dtype=torch.int32, device=dev)
    q = torch.randn(b, 1, hq, s.dim, dtype=dtype, device=dev)
    kc, vc = (torch.randn(b, n, hkv, s.dim, dtype=dtype, device=dev) for _ in range(2))
    shape = f"B={b} N<={n} H={hq}/{hkv} D={s.dim}"
    checks = [Check("decode contiguous, splits=auto", shape, dtype,
                    lambda: pf.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=True),
                    lambda: ref.kvcache_attention_ref(q, kc, vc, lens))]
    pk, pv, table = random_paged_kv(lens.tolist(), s.page, hkv, s.dim, dtype, device=dev)
    checks.append(Check(f"decode paged, page={s.page}", shape, dtype,
                        lambda: pf.flash_attn_with_kvcache(q, pk, pv, cache_seqlens=lens, block_table=table, num_splits=4),
                        lambda: ref.kvcache_attention_ref(q, pk, pv, lens, block_table=table)[0]))
    # decode that appends its own token first (k=, v=): positions lens[b], compared on copies
    kn, vn = (torch.randn(b, 1, hkv, s.dim, dtype=dtype, device=dev) for _ in range(2))
    before = lens - 1

    def appended_ref():
        k2, v2 = kc.clone(), vc.clone()
        ref.append_ref(k2, v2, kn, vn, before)
        return ref.kvcache_attention_ref(q, k2, v2, lens)[0]

    checks.append(Check("decode + append new k/v", shape, dtype,
                        lambda: pf.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=before),
                        appended_ref))
    return checks


def _cache_checks(s: Sizes, dev) -> list[Check]:
    hq, hkv, dtype = *s.heads, s.dtype
    t = min(sum(s.varlen), 1024)
    # two partial states (from the reference) over disjoint halves of the keys; merged = all keys
    q = torch.randn(1, t, hq, s.dim, dtype=dtype, device=dev)
    k, v = (torch.randn(1, 2 * t, hkv, s.dim, dtype=dtype, device=dev) for _ in range(2))
    (oa, la), (ob, lb) = (ref.attention_ref(q, k[:, i * t:(i + 1) * t], v[:, i * t:(i + 1) * t]) for i in range(2))
    oa, ob = oa[0].to(dtype), ob[0].to(dtype)
    la, lb = (x[0].transpose(0, 1).contiguous() for x in (la, lb))  # [Hq, T] -> [T, Hq]
    checks = [Check("merge_attn_states", f"T={t} H={hq} D={s.dim}", dtype,
                    lambda: pf.merge_attn_states(oa, la, ob, lb)[0],
                    lambda: ref.attention_ref(q, k, v)[0][0])]
    t = sum(s.varlen)
    kc, vc = (torch.randn(4 * t // s.page + 2, s.page, hkv, s.dim, dtype=dtype, device=dev) for _ in range(2))
    slots = torch.randperm(kc.shape[0] * s.page, device=dev)[:t]
    slots[::7] = -1  # padding tokens are skipped
    kn, vn = (torch.randn(t, hkv, s.dim, dtype=dtype, device=dev) for _ in range(2))

    def written():
        k2, v2 = kc.clone(), vc.clone()
        pf.write_kv_cache(kn, vn, k2, v2, slots)
        return k2, v2

    def written_ref():
        k2, v2 = kc.clone(), vc.clone()
        ref.write_kv_cache_ref(kn, vn, k2, v2, slots)
        return k2, v2

    checks.append(Check("write_kv_cache", f"T={t} pool={tuple(kc.shape)}", dtype, written, written_ref,
                        timed=lambda: pf.write_kv_cache(kn, vn, kc, vc, slots)))
    return checks


def run_kernel_checks(device: str | torch.device | None = None) -> list[dict]:
    """Run every public kernel once against the reference; on a GPU also time it.

    Returns rows ``{"kernel", "shape", "dtype", "rel_err", "ok", "ms"}`` (``ms`` None on a CPU).
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = GPU_SIZES if dev.type == "cuda" else CPU_SIZES
    torch.manual_seed(0)
    checks = (_prefill_checks(sizes, dev) + _varlen_checks(sizes, dev) + _decode_checks(sizes, dev)
              + _cache_checks(sizes, dev))
    rows = []
    for c in checks:
        row = {"kernel": c.name, "shape": c.shape, "dtype": str(c.dtype).removeprefix("torch."), "ms": None}
        try:
            got, want = _as_tuple(c.run()), _as_tuple(c.reference())
            errs, oks = zip(*(check_close(g, w, c.dtype) for g, w in zip(got, want)))
            row.update(rel_err=max(errs), ok=all(oks))
            if dev.type == "cuda" and row["ok"]:
                row["ms"] = time_ms(c.timed or c.run)
        except Exception as e:  # one broken kernel must not hide the others
            row.update(rel_err=None, ok=False, error=f"{type(e).__name__}: {e}"[:200])
        rows.append(row)
    return rows


def print_kernel_checks(rows: list[dict]) -> bool:
    """Print the table; returns whether every check passed."""
    table = Table("kernels", "pagedflash kernels against the fp32 reference",
                  {"kernel": "kernel", "shape": "shape", "dtype": "dtype", "rel_err": "rel. error", "ok": "pass",
                   "ms": "ms"},
                  note="rel. error = max |out - ref| / max |ref| (lse too, where returned); pass if every element "
                       "has |out - ref| <= atol * max|ref| + rtol * |ref| (pagedflash.testing), (atol, rtol) = "
                       + ", ".join(f"{str(k)[6:]} {v}" for k, v in TOLERANCES.items()))
    table.rows = [r | {"ok": "PASS" if r["ok"] else "FAIL"} for r in rows]
    print_table(table)
    for r in rows:
        if r.get("error"):
            print(f"  {r['kernel']}: {r['error']}")
    return all(r["ok"] for r in rows)


def main() -> int:
    t0 = time.perf_counter()
    ok = print_kernel_checks(run_kernel_checks())
    print(f"kernel checks: {'all passed' if ok else 'FAILURES'} in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1

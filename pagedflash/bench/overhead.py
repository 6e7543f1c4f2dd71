"""``pagedflash bench overhead``: the host time of one eager call, pagedflash's and SDPA's, measured
side by side in one process (issue 34: ours at most 1.5x SDPA's for decode, prefill and paged decode).

Workloads, bf16 on a GPU (fp32 on a CPU), 32 query heads over 8 KV heads, D = 128, batch 1:

- ``decode``: ``flash_attn_with_kvcache(q [1, 1, 32, 128], cache [1, 4096, 8, 128], cache_seqlens)``
  with ``cache_seqlens = [4096]``;
- ``prefill``: ``flash_attn_func(q [1, 128, 32, 128], k/v [1, 128, 8, 128], causal=True)``;
- ``paged decode``: the decode over a pool of 16-row pages through a block table;
- ``varlen``: the prefill packed, ``flash_attn_varlen_func(q [128, 32, 128], k/v [128, 8, 128],
  cu_seqlens_q = cu_seqlens_k = [0, 128], causal=True)``.

SDPA is ``F.scaled_dot_product_attention(q, k, v, is_causal=..., enable_gqa=True)`` on the same
problem in its ``[B, H, S, D]`` layout, with PyTorch's own backend choice (the ``sdpa backend``
column); its decode reads the whole cache (SDPA takes no lengths and no pages), and its varlen is
the prefill's problem (one sequence).

**Method (GPU).** The host time per call is the wall time of a loop of ``CALLS`` back-to-back calls
that does not wait for the GPU, divided by ``CALLS``: synchronize, start the clock, make the
calls, stop the clock, synchronize. These shapes take the GPU less time than the host needs to
launch them, so the queue never fills and the loop measures the host alone; ``wall`` times the
same loop through the final synchronize and shows it (were it well above ``host``, the GPU would be
the bound). The least of ``ROUNDS`` rounds (noise only adds to a host time; pagedflash's and
SDPA's rounds alternate, and go round by round through the workloads, so that a host whose speed
drifts slows all of them alike), after warm-up calls
(compiles, launch plans). Every call
runs under ``torch.inference_mode`` with pagedflash's value checks off (the checks that read
device metadata; a serving engine turns them off, :func:`pagedflash.validate.set_value_checks`).
Before timing, each of our outputs is checked against SDPA's.

Columns: ``ours``, the public call; ``public launch``, the same with
:mod:`pagedflash.ops.fastlaunch` off (Triton's ``kernel[grid](...)`` for every launch);
``value checks``, the public call with the device-reading checks on (on a GPU a host sync per
call, so it includes the GPU's time); ``checks``, the public call with ``attention_forward`` and
``kept_forward`` replaced by no-ops (input checks, the launch plan's key, output allocation, dispatch);
``launch``, ``attention_forward`` alone (launch plan, scratch, both kernel launches: the first
call's route; a signature's later calls launch their kept plan through ``kept_forward``, a few
frames shorter); ``launches``,
the kernel launches of one public call, and ``replay``, those launches alone, repeated through
:func:`pagedflash.ops.fastlaunch.run` with the call's arguments (on a GPU Triton's launcher and
the driver; ``launch`` minus ``replay`` is pagedflash's Python around them); ``sdpa``; and the
ratios to SDPA.

**CPU** (no GPU, no ``--quick`` needed): the kernels do not run. Each Triton launch is replaced by
a launcher that does nothing, reached through the fast-launch path exactly as the GPU's compiled
launcher is (``public launch`` then reaches the stand-in through pagedflash's public-launch code,
without Triton's), so the figures are pagedflash's host Python path minus Triton's C launcher, in
seconds. The clock is the thread's CPU time (``time.thread_time``) and each figure the least of the
rounds, which other processes on a busy machine inflate least. SDPA computes on the host there, on this thread alone, at N = 16 (keys and
prefill tokens), where its time is mostly dispatch; CPU ratios do not predict the GPU's.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
import types

import torch

import pagedflash as pf
from pagedflash import validate
from pagedflash.bench.common import FAIL, Config, device, has_gpu, host_wall_us
from pagedflash.bench.report import Table, print_summary, print_table, write_results
from pagedflash.ops import attention, combine, fastlaunch, scratch
from pagedflash.testing import check_close, random_block_table, to_paged

TARGET = 1.5  # issue 34: host time at most 1.5x SDPA's
HEADS, DIM, KEYS, PREFILL_TOKENS, PAGE = (32, 8), 128, 4096, 128, 16
CPU_SDPA_LEN = 16
CALLS, ROUNDS = 200, 7
QUICK_CALLS, QUICK_ROUNDS = 20, 3


# ---------------------------------------------------------------- the CPU's stand-in launches


class _NoLaunch:
    """A compiled kernel that launches nothing: what ``_DryKernel`` returns and fastlaunch binds."""

    function = 0
    packed_metadata = (4, 1, 0)

    @staticmethod
    def run(*args) -> None:
        return None


class _DryKernel:
    """Stands in for a ``@triton.jit`` kernel: same parameters, launches nothing."""

    def __init__(self, real) -> None:
        params = getattr(real, "params", None)
        if params is None:  # the interpreter's kernels: read the constexprs off the signature
            sig = inspect.signature(real.fn)
            params = [types.SimpleNamespace(name=name, is_constexpr="constexpr" in str(p.annotation))
                      for name, p in sig.parameters.items()]
        self.params = params
        self.pre_run_hooks = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _NoLaunch


@contextlib.contextmanager
def dry_run():
    """Inside: pagedflash's attention and combine launches do nothing, through the same host path
    as compiled kernels on a GPU (fast-launch handles included); split partials are reused as on a
    GPU. Plans made inside are dropped on the way out."""
    kernels = [(attention, "_attention_kernel"), (combine, "_combine_kernel")]
    saved = [getattr(module, name) for module, name in kernels]
    knobs = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None, debug=False)
    reuse = scratch.CPU
    attention.clear_plans()
    try:
        for (module, name), real in zip(kernels, saved):
            setattr(module, name, _DryKernel(real))
        scratch.CPU = True
        with fastlaunch.assume_api(lambda: 0, lambda index: 0, knobs):
            yield
    finally:
        for (module, name), real in zip(kernels, saved):
            setattr(module, name, real)
        scratch.CPU = reuse
        scratch.clear()
        attention.clear_plans()


@contextlib.contextmanager
def fast_launch(enabled: bool):
    previous = fastlaunch.set_enabled(enabled)
    try:
        yield
    finally:
        fastlaunch.set_enabled(previous)


@contextlib.contextmanager
def recorded_launches(launches: list):
    """Inside: every launch that goes through a fast-launch handle is also appended to ``launches``
    as ``(slot, fn, grid, args)``, which :func:`replay` repeats."""
    real = fastlaunch.run

    def run(slot, fn, grid, args):
        done = real(slot, fn, grid, args)
        if done:
            launches.append((slot, fn, grid, args))
        return done

    fastlaunch.run = run
    try:
        yield
    finally:
        fastlaunch.run = real


def replay(launches: list) -> None:
    """Repeat recorded fast launches (:func:`recorded_launches`)."""
    for slot, fn, grid, args in launches:
        if not fastlaunch.run(slot, fn, grid, args):
            raise RuntimeError("overhead: a recorded launch no longer goes through its fast handle")


@contextlib.contextmanager
def without_attention_forward():
    """Inside: every pagedflash module's ``attention_forward`` (and ``kept_forward``, its form for
    a kept public plan) returns the output it was given (or q) at once, so a public call times what
    it does before the launch."""
    def skip(q, k, v, *, out=None, **kwargs):
        return (q if out is None else out), None

    def skip_kept(signature, q, k, v, out, *args):
        return out, None

    replaced = []
    for name, real, fake in (("attention_forward", attention.attention_forward, skip),
                             ("kept_forward", attention.kept_forward, skip_kept)):
        for module_name, m in list(sys.modules.items()):
            if m is not None and module_name.startswith("pagedflash") and getattr(m, name, None) is real:
                setattr(m, name, fake)
                replaced.append((m, name, real))
    try:
        yield
    finally:
        for m, name, real in replaced:
            setattr(m, name, real)


# ---------------------------------------------------------------- workloads


def _sdpa_backend(q, k, v, causal: bool) -> str:
    """The backend PyTorch dispatches this SDPA call to (a private query; "?" where it is absent)."""
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, causal, enable_gqa=True)
        return SDPBackend(choice).name.lower()
    except Exception:  # noqa: BLE001  (informational only)
        return "?"


def workloads(dtype: torch.dtype) -> list[dict]:
    """Each workload: ``ours()`` the public call, ``launch()`` its attention_forward, ``sdpa()``
    and what it computes (``sdpa_args``), and the SDPA shape."""
    dev = device()
    gen = torch.Generator(device=dev).manual_seed(0)
    hq, hkv = HEADS

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    scale = DIM ** -0.5
    sdpa_len = KEYS if has_gpu() else CPU_SDPA_LEN
    sdpa_tokens = PREFILL_TOKENS if has_gpu() else CPU_SDPA_LEN
    F = torch.nn.functional

    # decode over a contiguous cache
    q = randn(1, 1, hq, DIM)
    k_cache, v_cache = randn(1, KEYS, hkv, DIM), randn(1, KEYS, hkv, DIM)
    seqlens = torch.full((1,), KEYS, dtype=torch.int32, device=dev)
    sq, sk, sv = q.transpose(1, 2), k_cache[:, :sdpa_len].transpose(1, 2), v_cache[:, :sdpa_len].transpose(1, 2)
    sq, sk, sv = sq.contiguous(), sk.contiguous(), sv.contiguous()
    decode = dict(
        name="decode", shape=f"B=1 N={KEYS} {hq}/{hkv} D={DIM}",
        ours=lambda: pf.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens),
        launch=lambda: attention.attention_forward(
            q, k_cache, v_cache, batch=1, max_seqlen_q=1, max_seqlen_k=KEYS, sm_scale=scale, window=(-1, 0),
            softcap=0.0, seqused_k=seqlens),
        sdpa=lambda: F.scaled_dot_product_attention(sq, sk, sv, enable_gqa=True),
        sdpa_args=(sq, sk, sv, False), sdpa_shape=f"N={sdpa_len}",
    )

    # the same decode over a pool of pages, in a shuffled order
    table = random_block_table([KEYS // PAGE], KEYS // PAGE, device=dev)
    k_pool, v_pool = to_paged(k_cache, PAGE, table), to_paged(v_cache, PAGE, table)
    paged = dict(
        name="paged decode", shape=f"B=1 N={KEYS} {hq}/{hkv} D={DIM} page {PAGE}",
        ours=lambda: pf.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table),
        launch=lambda: attention.attention_forward(
            q, k_pool, v_pool, batch=1, max_seqlen_q=1, max_seqlen_k=KEYS, sm_scale=scale, window=(-1, 0),
            softcap=0.0, seqused_k=seqlens, block_table=table),
        sdpa=decode["sdpa"], sdpa_args=decode["sdpa_args"], sdpa_shape=decode["sdpa_shape"],
    )

    # causal prefill
    pq, pk, pv = randn(1, PREFILL_TOKENS, hq, DIM), randn(1, PREFILL_TOKENS, hkv, DIM), randn(1, PREFILL_TOKENS, hkv, DIM)
    tq, tk, tv = (x[:, :sdpa_tokens].transpose(1, 2).contiguous() for x in (pq, pk, pv))
    prefill = dict(
        name="prefill", shape=f"B=1 {PREFILL_TOKENS} tokens causal {hq}/{hkv} D={DIM}",
        ours=lambda: pf.flash_attn_func(pq, pk, pv, causal=True),
        launch=lambda: attention.attention_forward(
            pq, pk, pv, batch=1, max_seqlen_q=PREFILL_TOKENS, max_seqlen_k=PREFILL_TOKENS, sm_scale=scale,
            window=(-1, 0), softcap=0.0),
        sdpa=lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True),
        sdpa_args=(tq, tk, tv, True), sdpa_shape=f"{sdpa_tokens} tokens",
    )

    # the same prefill packed: one sequence of PREFILL_TOKENS
    vq, vk, vv = pq[0], pk[0], pv[0]
    cu = torch.tensor([0, PREFILL_TOKENS], dtype=torch.int32, device=dev)
    varlen = dict(
        name="varlen", shape=f"1 x {PREFILL_TOKENS} tokens causal {hq}/{hkv} D={DIM}",
        ours=lambda: pf.flash_attn_varlen_func(vq, vk, vv, cu, cu, PREFILL_TOKENS, PREFILL_TOKENS, causal=True),
        launch=lambda: attention.attention_forward(
            vq, vk, vv, batch=1, max_seqlen_q=PREFILL_TOKENS, max_seqlen_k=PREFILL_TOKENS, sm_scale=scale,
            window=(-1, 0), softcap=0.0, cu_seqlens_q=cu, cu_seqlens_k=cu),
        sdpa=prefill["sdpa"], sdpa_args=prefill["sdpa_args"], sdpa_shape=prefill["sdpa_shape"],
    )
    return [decode, prefill, paged, varlen]


def _correct(case: dict, dtype) -> tuple[float, bool]:
    """Our output against SDPA's (GPU only: on the CPU nothing is computed); a packed output
    ``[tokens, H, D]`` against SDPA's one sequence."""
    out = case["ours"]()
    ref = case["sdpa"]().transpose(1, 2)
    return check_close(out.view(ref.shape), ref, dtype)


@contextlib.contextmanager
def _one_thread():
    """PyTorch's CPU kernels on this thread only, so that its CPU time counts all of their work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _timing(calls: int, rounds: int) -> dict:
    # the least of the rounds: noise only adds to a host time. On the CPU the clock is this thread's
    # CPU time, which a busy machine inflates least.
    timing = dict(calls=calls, rounds=rounds, warmup=3, stat=min)
    if not has_gpu():
        timing.update(clock=time.thread_time)
    return timing


def measure_cases(cases: list[dict], *, calls: int, rounds: int, dtype) -> list[dict]:
    """One row per case. The headline loops (pagedflash's, then SDPA's) go round by round through
    every case, so that a stretch of slow host (a process finishing beside the bench) falls on all
    workloads alike, not on whichever was timed first; then each case's breakdown columns."""
    timing = _timing(calls, rounds)
    one = {**timing, "rounds": 1}
    rows = []
    for case in cases:
        row = {"workload": case["name"], "shape": case["shape"]}
        if has_gpu():
            err, ok = _correct(case, dtype)
            row["err"] = err
            if not ok:
                row.update(ours=FAIL, vs_sdpa=FAIL)
        rows.append(row)
    live = [(case, row, [], []) for case, row in zip(cases, rows) if row.get("ours") != FAIL]
    for _ in range(rounds):
        for case, _, ours, sdpa in live:
            ours.append(host_wall_us(case["ours"], **one))
            with contextlib.nullcontext() if has_gpu() else _one_thread():
                sdpa.append(host_wall_us(case["sdpa"], **one))
    for case, row, ours, sdpa in live:
        row["ours"], row["ours_wall"] = (min(x) for x in zip(*ours))
        row["sdpa"], row["sdpa_wall"] = (min(x) for x in zip(*sdpa))
        _breakdown(case, row, timing)
    return rows


def _breakdown(case: dict, row: dict, timing: dict) -> None:
    """The columns that take the call apart (module doc), and the ratios to SDPA."""
    with fast_launch(False):
        row["public"], _ = host_wall_us(case["ours"], **timing)
    with validate.value_checks(True):
        row["checked"], _ = host_wall_us(case["ours"], **timing)
    with without_attention_forward():
        row["checks"], _ = host_wall_us(case["ours"], **timing)
    row["launch"], _ = host_wall_us(case["launch"], **timing)
    launches = []
    case["ours"]()  # binds the handles again if a public launch above dropped them
    with recorded_launches(launches):
        case["ours"]()
    row["launches"] = len(launches)
    row["replay"], _ = host_wall_us(lambda: replay(launches), **timing)
    row["sdpa_shape"] = case["sdpa_shape"]
    row["sdpa_backend"] = _sdpa_backend(*case["sdpa_args"])
    row["vs_sdpa"] = row["ours"] / row["sdpa"]
    row["public_vs_sdpa"] = row["public"] / row["sdpa"]
    row["meets_target"] = row["vs_sdpa"] <= TARGET


def overhead_table(*, calls: int, rounds: int) -> tuple[Table, str]:
    dtype = torch.bfloat16 if has_gpu() else torch.float32
    gpu = has_gpu()
    table = Table(
        "overhead", "Host time per eager call, µs (" + ("GPU" if gpu else "CPU: launches replaced, see note") + ")",
        {"workload": "workload", "ours": "pagedflash", "public": "public launch", "checked": "value checks",
         "checks": "checks", "launch": "launch", "launches": "launches", "replay": "replay", "sdpa": "SDPA",
         "vs_sdpa": "pf÷SDPA",
         "public_vs_sdpa": "public÷SDPA", "ours_wall": "pf wall", "sdpa_backend": "SDPA backend"},
        note=(f"Least of {rounds} loops of {calls} calls without waiting for the GPU (pagedflash's and SDPA's "
              f"loops alternating, round by round through the workloads); value checks off except in 'value checks'; target pf÷SDPA <= {TARGET}. "
              + ("" if gpu else "CPU: this thread's CPU time; Triton launches replaced by a no-op through the "
                 f"same host path; SDPA computes at N={CPU_SDPA_LEN}: ratios are not the GPU's.")),
    )
    with torch.inference_mode(), validate.value_checks(False):
        context = contextlib.nullcontext() if gpu else dry_run()
        with context:
            status = fastlaunch.status() if gpu else "dry run (CPU)"
            table.rows.extend(measure_cases(list(workloads(dtype)), calls=calls, rounds=rounds, dtype=dtype))
            if gpu:
                status = fastlaunch.status()
    return table, status


def main(cfg: Config) -> int:
    calls, rounds = (QUICK_CALLS, QUICK_ROUNDS) if cfg.quick else (CALLS, ROUNDS)
    table, status = overhead_table(calls=calls, rounds=rounds)
    print_table(table)
    by_name = {r["workload"]: r for r in table.rows}
    failed = sum(r.get("ours") == FAIL for r in table.rows)
    summary = {f"{name.replace(' ', '_')}_vs_sdpa": by_name[name].get("vs_sdpa") for name in by_name}
    # direct C launches (PAGEDFLASH_DIRECT_LAUNCH) change the launch columns: the file says which ran
    summary.update(fast_launch=status, direct_launch=fastlaunch.direct_status(), target=TARGET,
                   failures=failed,
                   method=(f"host wall time per call: least of {rounds} loops of {calls} eager calls that do not "
                           "wait for the GPU (pagedflash's and SDPA's alternating), value checks off" if has_gpu() else
                           f"CPU time of the calling thread, Triton launches replaced by no-ops: least of {rounds} "
                           f"loops of {calls} calls"))
    print_summary(summary)
    path = write_results("overhead", [table], cfg.out, quick=cfg.quick, summary=summary)
    print(f"wrote {path}")
    return 1 if failed else 0

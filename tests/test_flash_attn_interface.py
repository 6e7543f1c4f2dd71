"""flash-attn 2's signatures (pagedflash.flash_attn_interface): positional order, defaults, return
values, packed variants, rotary embedding and cache_batch_idx in flash_attn_with_kvcache."""

import inspect

import pytest
import torch
from helpers import DEVICE, DTYPES, assert_close, cu_seqlens, ids, randn

import pagedflash
from pagedflash import flash_attn_interface as fa
from pagedflash import reference as ref
from pagedflash import validate

DTYPE = DTYPES[-1]
# flash-attn 2.6+'s parameter lists (flash_attn/flash_attn_interface.py), in order
COMMON = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
          "return_attn_probs"]
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v", *COMMON],
    "flash_attn_qkvpacked_func": ["qkv", *COMMON],
    "flash_attn_kvpacked_func": ["q", "kv", *COMMON],
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", *COMMON,
                               "block_table"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen", *COMMON],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                        *COMMON],
    "flash_attn_with_kvcache": ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                                "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
                                "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
                                "return_softmax_lse"],
}


# pagedflash's extensions, after every flash-attn 2 parameter: attention sinks (flash-attn 4's name)
# and fp8 K/V descales (flash-attn 3's names)
EXTENSIONS = {name: ["learnable_sink"] for name in SIGNATURES} | {
    name: ["learnable_sink", "k_descale", "v_descale"] for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache")}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_are_flash_attns(name):
    params = inspect.signature(getattr(fa, name)).parameters
    assert list(params) == SIGNATURES[name] + EXTENSIONS[name]
    assert all(params[p].default is False for p in ("causal",) if p in params)  # flash-attn's default


def test_positional_call_and_return_values():
    q, k, v = randn(2, 37, 4, 64, dtype=DTYPE), randn(2, 50, 2, 64, dtype=DTYPE), randn(2, 50, 2, 64, dtype=DTYPE)
    want, want_lse = pagedflash.flash_attn_func(q, k, v, softmax_scale=0.1, causal=True, return_lse=True)
    # flash-attn's positional order: dropout_p, softmax_scale, causal
    assert torch.equal(fa.flash_attn_func(q, k, v, 0.0, 0.1, True), want)
    out, lse, probs = fa.flash_attn_func(q, k, v, 0.0, 0.1, True, return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and probs is None
    for bad, match in ((dict(dropout_p=0.1), "dropout_p: .*expected 0.0"), (dict(alibi_slopes=torch.ones(4)),
                                                                           "alibi_slopes: .*expected None")):
        with pytest.raises(ValueError, match=match):
            fa.flash_attn_func(q, k, v, **bad)


def test_packed_variants():
    qkv = randn(2, 30, 3, 4, 32, dtype=DTYPE)
    q, k, v = qkv.unbind(2)
    want = pagedflash.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(fa.flash_attn_qkvpacked_func(qkv, causal=True), want)
    assert torch.equal(fa.flash_attn_kvpacked_func(q, qkv[:, :, 1:], causal=True), want)
    with pytest.raises(ValueError, match=r"qkv: expected 3 along dimension 2"):
        fa.flash_attn_qkvpacked_func(qkv[:, :, :2])

    lens = [7, 20]
    cu = cu_seqlens(lens)
    packed = randn(sum(lens), 3, 4, 32, dtype=DTYPE)
    q, k, v = packed.unbind(1)
    want = pagedflash.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert torch.equal(fa.flash_attn_varlen_qkvpacked_func(packed, cu, max(lens), causal=True), want)
    assert torch.equal(fa.flash_attn_varlen_kvpacked_func(q, packed[:, 1:], cu, cu, max(lens), max(lens),
                                                          causal=True), want)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), 0.0, None, True,
                                            return_attn_probs=True)
    assert torch.equal(out, want) and lse.shape == (4, sum(lens))


def _rotary_tables(seqlen, rotary_dim):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, device=DEVICE, dtype=torch.float32) / rotary_dim)
    angles = torch.arange(seqlen, device=DEVICE, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles, angles.cos().to(DTYPE), angles.sin().to(DTYPE)


def _rotate_ref(x, angles, positions, interleaved):
    """Rotation as complex multiplication (independent of the implementation under test)."""
    half = angles.shape[1]
    theta = angles[positions].unsqueeze(2)  # [B, S, 1, half]
    xr = x[..., : 2 * half].double()
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2]) * torch.polar(torch.ones_like(theta).double(), theta.double())
        rot = torch.stack([z.real, z.imag], dim=-1).flatten(-2)
    else:
        z = torch.complex(xr[..., :half], xr[..., half:]) * torch.polar(torch.ones_like(theta).double(), theta.double())
        rot = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([rot.to(x.dtype), x[..., 2 * half:]], dim=-1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_kvcache_rotary(interleaved, causal):
    b, s_max, hq, hkv, d, s_new, rotary_dim = 2, 64, 4, 2, 64, 3, 32
    angles, cos, sin = _rotary_tables(80, rotary_dim)
    q, k_new, v_new = randn(b, s_new, hq, d, dtype=DTYPE), randn(b, s_new, hkv, d, dtype=DTYPE), randn(
        b, s_new, hkv, d, dtype=DTYPE)
    k_cache, v_cache = randn(b, s_max, hkv, d, dtype=DTYPE), randn(b, s_max, hkv, d, dtype=DTYPE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    lens = torch.tensor([5, 40], dtype=torch.int32, device=DEVICE)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, lens, causal=causal,
                                          rotary_interleaved=interleaved, return_softmax_lse=True)
    steps = torch.arange(s_new, device=DEVICE)
    k_pos = lens.long()[:, None] + steps
    q_pos = k_pos if causal else lens.long()[:, None] + 0 * steps  # non-causal: every query at cache_seqlens
    q_rot, k_rot = _rotate_ref(q, angles, q_pos, interleaved), _rotate_ref(k_new, angles, k_pos, interleaved)
    ref.append_ref(k_ref, v_ref, k_rot, v_new, lens)
    assert_close(k_cache, k_ref, DTYPE, name="k_cache")
    assert torch.equal(v_cache, v_ref)
    want, want_lse = ref.kvcache_attention_ref(q_rot, k_ref, v_ref, lens + s_new, causal=causal)
    assert_close(out, want, DTYPE)
    assert_close(lse, want_lse, torch.float32 if DTYPE == torch.float32 else torch.float16, name="lse")


def test_kvcache_batch_idx():
    b_cache, s_max, hq, hkv, d = 5, 48, 4, 2, 32
    k_cache, v_cache = randn(b_cache, s_max, hkv, d, dtype=DTYPE), randn(b_cache, s_max, hkv, d, dtype=DTYPE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    idx = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([10, 0, 46], dtype=torch.int32, device=DEVICE)
    q, k_new, v_new = randn(3, 2, hq, d, dtype=DTYPE), randn(3, 2, hkv, d, dtype=DTYPE), randn(3, 2, hkv, d, dtype=DTYPE)
    for splits in (1, 0):
        out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, cache_batch_idx=idx,
                                         causal=True, num_splits=splits)
        rows = idx.long()
        k_rows, v_rows = k_ref[rows].clone(), v_ref[rows].clone()
        ref.append_ref(k_rows, v_rows, k_new, v_new, lens)
        k_ref[rows], v_ref[rows] = k_rows, v_rows
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # rows 1 and 2 untouched
        assert_close(out, ref.kvcache_attention_ref(q, k_rows, v_rows, lens + 2, causal=True)[0], DTYPE)
    # the whole row when cache_seqlens is None
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_batch_idx=idx)
    full = torch.full((3,), s_max, dtype=torch.int32, device=DEVICE)
    assert_close(out, ref.kvcache_attention_ref(q, k_cache[idx.long()], v_cache[idx.long()], full, causal=False)[0],
                 DTYPE)


def _bad_call(case):
    """A flash_attn_with_kvcache call with one thing wrong (or unsupported)."""
    q = randn(2, 1, 4, 32, dtype=DTYPE)
    k_cache, v_cache = randn(4, 16, 2, 32, dtype=DTYPE), randn(4, 16, 2, 32, dtype=DTYPE)
    k_new, v_new = randn(2, 1, 2, 32, dtype=DTYPE), randn(2, 1, 2, 32, dtype=DTYPE)
    _, cos, sin = _rotary_tables(16, 8)
    lens = torch.tensor([3, 9], dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([1, 3], dtype=torch.int32, device=DEVICE)
    rotary = dict(k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, cache_batch_idx=rows)
    call = {
        "leftpad": dict(cache_leftpad=lens, cache_batch_idx=rows),
        "alibi": dict(alibi_slopes=torch.ones(4), cache_batch_idx=rows),
        "cos only": {**rotary, "rotary_sin": None},
        "cos not a tensor": {**rotary, "rotary_cos": 0.5},
        "rotary without k": {**rotary, "k": None, "v": None},
        "rotary_dim > D": {**rotary, "rotary_cos": torch.cat([cos] * 5, 1), "rotary_sin": torch.cat([sin] * 5, 1)},
        "rotary without lengths": {**rotary, "cache_seqlens": None},
        "rotary shorter than the cache": {**rotary, "rotary_cos": cos[:15], "rotary_sin": sin[:15]},
        "batch idx not int32": dict(cache_batch_idx=rows.long()),
        "batch idx out of range": dict(cache_batch_idx=rows + 1),
        "batch idx with pages": dict(cache_batch_idx=rows, cache_seqlens=lens,
                                     block_table=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)),
    }[case]
    return lambda: fa.flash_attn_with_kvcache(q, k_cache, v_cache, **call)


@pytest.mark.parametrize("case,error,match", [
    ("leftpad", ValueError, "cache_leftpad: .*expected None"),
    ("alibi", ValueError, "alibi_slopes: .*expected None"),
    ("cos only", ValueError, "rotary_cos, rotary_sin: pass both"),
    ("cos not a tensor", TypeError, "rotary_cos: expected a torch.Tensor"),
    ("rotary without k", ValueError, "k, v: required with rotary_cos/rotary_sin"),
    ("rotary_dim > D", ValueError, r"rotary_cos: expected \[seqlen_ro, rotary_dim / 2\] with rotary_dim <= head dim"),
    ("rotary without lengths", ValueError, "cache_seqlens: required with rotary"),
    ("rotary shorter than the cache", ValueError,
     r"rotary_cos: expected at least 16 rows, the cache's length seqlen_k \(as flash-attn requires\), got shape \(15, 4\)"),
    ("batch idx not int32", TypeError, "cache_batch_idx"),
    ("batch idx out of range", ValueError, r"cache_batch_idx: expected rows in \[0, 4\)"),
    ("batch idx with pages", ValueError, "cache_batch_idx: not supported with block_table"),
])
def test_kvcache_rejects(case, error, match):
    with validate.value_checks(True):  # cache_batch_idx's values: the debug mode's
        with pytest.raises(error, match=match):
            _bad_call(case)()
        with pytest.raises(RuntimeError, match=match):  # what code written for flash-attn catches
            _bad_call(case)()


def test_kvcache_rotary_with_batch_idx_int_lengths_and_a_window():
    """Rotary together with cache_batch_idx and an int cache_seqlens; a non-causal local window
    rotates each query at its own position, a window as long as the cache counts as no window."""
    b_cache, s_max, hq, hkv, d = 3, 40, 4, 2, 32
    angles, cos, sin = _rotary_tables(64, 16)
    q, k_new, v_new = randn(2, 2, hq, d, dtype=DTYPE), randn(2, 2, hkv, d, dtype=DTYPE), randn(2, 2, hkv, d, dtype=DTYPE)
    rows = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    steps = torch.arange(2, device=DEVICE)
    for window, per_token in (((5, 1), True), ((-1, s_max), False)):
        k_cache, v_cache = randn(b_cache, s_max, hkv, d, dtype=DTYPE), randn(b_cache, s_max, hkv, d, dtype=DTYPE)
        k_rows, v_rows = k_cache[rows.long()].clone(), v_cache[rows.long()].clone()
        out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, 20, rows, window_size=window,
                                         rotary_interleaved=False)
        lens = torch.full((2,), 20, dtype=torch.int32, device=DEVICE)
        k_pos = 20 + steps.expand(2, 2)
        q_rot = _rotate_ref(q, angles, k_pos if per_token else 20 + 0 * k_pos, False)
        ref.append_ref(k_rows, v_rows, _rotate_ref(k_new, angles, k_pos, False), v_new, lens)
        assert_close(k_cache[rows.long()], k_rows, DTYPE, name="k_cache")
        want = ref.kvcache_attention_ref(q_rot, k_rows, v_rows, lens + 2, causal=False, window_size=window)[0]
        assert_close(out, want, DTYPE)


def test_kvcache_rotary_over_pages():
    """Rotary with a paged cache: the new keys land rotated in their pages, q at its positions."""
    from helpers import make_pool

    page, hq, hkv, d = 16, 4, 2, 32
    lens = torch.tensor([0, 21, 35], dtype=torch.int32, device=DEVICE)
    k_cache, v_cache, table = make_pool([n + 2 for n in lens.tolist()], page, hkv, d, DTYPE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    angles, cos, sin = _rotary_tables(64, 32)
    q, k_new, v_new = randn(3, 2, hq, d, dtype=DTYPE), randn(3, 2, hkv, d, dtype=DTYPE), randn(3, 2, hkv, d, dtype=DTYPE)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, lens, block_table=table, causal=True)
    pos = lens.long()[:, None] + torch.arange(2, device=DEVICE)
    ref.append_ref(k_ref, v_ref, _rotate_ref(k_new, angles, pos, True), v_new, lens, block_table=table)
    assert_close(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0), DTYPE, name="k_cache")
    want = ref.kvcache_attention_ref(_rotate_ref(q, angles, pos, True), k_ref, v_ref, lens + 2, block_table=table,
                                     causal=True)[0]
    assert_close(out, want, DTYPE)


def _fa2_rotary_positions(lens, sq, s_new, seqlen_k, causal, window):
    """flash-attn 2's rotary rows, restated from its source (csrc/flash_attn/flash_api.cpp:
    mha_fwd_kvcache and set_params_fprop; flash_fwd_kernel.h: the Append_KV rotary copies), as an
    independent reference: a one-row call is not causal; causal sets right = 0; a side >= seqlen_k
    is -1; causal means left < 0 and right == 0, local any other side >= 0; q row i sits at
    cache_seqlens + i when causal or local, else at cache_seqlens; new key t at cache_seqlens + t."""
    left, right = window
    if sq == 1:
        causal = False
    if causal:
        right = 0
    left, right = (-1 if w >= seqlen_k else w for w in (left, right))
    is_causal = left < 0 and right == 0
    is_local = (left >= 0 or right >= 0) and not is_causal
    base = lens.long()[:, None]
    q_pos = base + torch.arange(sq, device=DEVICE) if is_causal or is_local else base.expand(-1, sq)
    return q_pos, base + torch.arange(s_new, device=DEVICE)


CAPACITY = 32  # seqlen_k of every layout below; rotary tables have exactly this many rows (flash-attn's minimum)
MODES = {
    "causal": (True, (-1, -1)),
    "causal+left": (True, (5, -1)),
    "local": (False, (4, 1)),
    "left only": (False, (6, -1)),
    "neither": (False, (-1, -1)),
    "right as long as the cache": (False, (-1, CAPACITY)),
    "left one short of the cache": (False, (CAPACITY - 1, -1)),
}


# every mode over a contiguous cache; the paged and cache_batch_idx layouts with a per-row and a shared mode
# each (the layout changes where keys land, not the positions); both rotary layouts alternate
ROTARY_CASES = [(mode, "contiguous", i % 2 == 0) for i, mode in enumerate(sorted(MODES))] + [
    ("causal", "paged", False), ("left only", "paged", True), ("neither", "paged", True),
    ("right as long as the cache", "paged", False), ("local", "batch_idx", True), ("neither", "batch_idx", False),
]


@pytest.mark.parametrize("mode,layout,interleaved", ROTARY_CASES, ids=ids)
def test_kvcache_rotary_positions_are_flash_attns(mode, layout, interleaved):
    """Modes x cache layouts, with more queries than new keys (so the modes' positions differ) and a
    rotary_dim below the head dim, against flash-attn 2's rule restated in _fa2_rotary_positions."""
    causal, window = MODES[mode]
    b, sq, s_new, hq, hkv, d, rotary_dim, page = 3, 5, 3, 4, 2, 32, 16, 8
    lens = torch.tensor([0, 7, 24], dtype=torch.int32, device=DEVICE)
    angles, cos, sin = _rotary_tables(CAPACITY, rotary_dim)
    q, k_new, v_new = randn(b, sq, hq, d, dtype=DTYPE), randn(b, s_new, hkv, d, dtype=DTYPE), randn(
        b, s_new, hkv, d, dtype=DTYPE)
    table, rows = None, None
    if layout == "paged":
        from helpers import make_pool

        k_cache, v_cache, table = make_pool([n + s_new for n in lens.tolist()], page, hkv, d, DTYPE)
        assert table.shape[1] * page == CAPACITY
    elif layout == "batch_idx":
        k_cache, v_cache = randn(5, CAPACITY, hkv, d, dtype=DTYPE), randn(5, CAPACITY, hkv, d, dtype=DTYPE)
        rows = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    else:
        k_cache, v_cache = randn(b, CAPACITY, hkv, d, dtype=DTYPE), randn(b, CAPACITY, hkv, d, dtype=DTYPE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, lens, rows, None, table,
                                     causal=causal, window_size=window, rotary_interleaved=interleaved)

    q_pos, k_pos = _fa2_rotary_positions(lens, sq, s_new, CAPACITY, causal, window)
    q_rot, k_rot = _rotate_ref(q, angles, q_pos, interleaved), _rotate_ref(k_new, angles, k_pos, interleaved)
    if rows is not None:  # the rows this batch reads and appends to
        k_ref, v_ref = k_ref[rows.long()], v_ref[rows.long()]
        k_cache, v_cache = k_cache[rows.long()], v_cache[rows.long()]
    ref.append_ref(k_ref, v_ref, k_rot, v_new, lens, block_table=table)
    assert_close(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0), DTYPE, name="k_cache")
    want = ref.kvcache_attention_ref(q_rot, k_ref, v_ref, lens + s_new, block_table=table, causal=causal,
                                     window_size=window)[0]
    assert_close(out, want, DTYPE)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter, on the NaN query rows
def test_kvcache_rotary_queries_at_cache_seqlens_in_a_full_cache():
    """The issue's case (flash-attn's test_flash_attn_kvcache: batch 1, seqlen_q 128, a cache of 128, D 32,
    rotary_fraction 0.5, fewer new keys than queries): neither causal nor local, every query rotates
    at cache_seqlens, so a table as long as the cache is enough (pagedflash asked for cache_seqlens +
    seqlen_q rows and refused it). Causal, the query rows would run past the table: those rows get NaN
    and a positions fault, or in the debug mode a clear error."""
    sq, s_new, s_max, d, rotary_dim = 128, 5, 128, 32, 16
    angles, cos, sin = _rotary_tables(s_max, rotary_dim)
    lens = torch.tensor([s_max - s_new - 10], dtype=torch.int32, device=DEVICE)
    q, k_new, v_new = randn(1, sq, 4, d, dtype=DTYPE), randn(1, s_new, 2, d, dtype=DTYPE), randn(1, s_new, 2, d,
                                                                                                   dtype=DTYPE)
    k_cache, v_cache = randn(1, s_max, 2, d, dtype=DTYPE), randn(1, s_max, 2, d, dtype=DTYPE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, lens, rotary_interleaved=False)
    q_pos, k_pos = _fa2_rotary_positions(lens, sq, s_new, s_max, False, (-1, -1))
    ref.append_ref(k_ref, v_ref, _rotate_ref(k_new, angles, k_pos, False), v_new, lens)
    assert_close(k_cache, k_ref, DTYPE, name="k_cache")
    want = ref.kvcache_attention_ref(_rotate_ref(q, angles, q_pos, False), k_ref, v_ref, lens + s_new, causal=False)[0]
    assert_close(out, want, DTYPE)

    validate.invalid_metadata()  # earlier tests' records
    out = fa.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, cos, sin, lens, causal=True,
                                     rotary_interleaved=False)
    inside = s_max - int(lens[0])  # query rows 0 .. inside - 1 rotate at positions inside the table
    q_pos = _fa2_rotary_positions(lens, sq, s_new, s_max, True, (-1, -1))[0].clamp(max=s_max - 1)  # rows past: unused
    want = ref.kvcache_attention_ref(_rotate_ref(q, angles, q_pos, False), k_ref, v_ref, lens + s_new, causal=True)[0]
    assert_close(out[:, :inside], want[:, :inside], DTYPE)
    assert bool(out[:, inside:].isnan().all())  # the others NaN, and the fault recorded
    with pytest.raises(ValueError, match=f"positions: expected values in .* found token {sq - 1} invalid"):
        validate.raise_if_invalid()

    k_before = k_cache.clone()
    with validate.value_checks(True), pytest.raises(
            ValueError, match="rotary_cos: 128 positions, but this causal or local call rotates query row "
                              "127 at cache_seqlens \\+ 127 = position 240"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, lens, causal=True)
    assert torch.equal(k_cache, k_before)  # refused before anything was written


def test_every_input_error_is_also_a_runtime_error():
    """Code written for flash-attn catches its TORCH_CHECK failures as RuntimeError; the same code
    catches pagedflash's ValueError/TypeError (same message) from every entry point here."""
    q, k = randn(1, 8, 4, 32, dtype=DTYPE), randn(1, 8, 2, 32, dtype=DTYPE)
    cu = cu_seqlens([8])
    calls = {
        "flash_attn_func": (lambda: fa.flash_attn_func(q, k, k, 0.5), ValueError, "dropout_p"),
        "qkvpacked": (lambda: fa.flash_attn_qkvpacked_func(q), ValueError, "qkv: expected 3 along dimension 2"),
        "kvpacked": (lambda: fa.flash_attn_kvpacked_func(q, "kv"), TypeError, "kv: expected a torch.Tensor"),
        "varlen": (lambda: fa.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 8, 8, softcap="1"), TypeError,
                   "softcap"),
        "varlen qkvpacked": (lambda: fa.flash_attn_varlen_qkvpacked_func(q[0], cu, 8), ValueError, "qkv"),
        "varlen kvpacked": (lambda: fa.flash_attn_varlen_kvpacked_func(q[0], q[0], cu, cu, 8, 8), ValueError, "kv"),
        "kvcache": (lambda: fa.flash_attn_with_kvcache(q, k, k, window_size=(1.5, -1)), TypeError, "window_size"),
    }
    for name, (call, kind, match) in calls.items():
        with pytest.raises(RuntimeError, match=match) as caught:
            call()
        assert isinstance(caught.value, kind), name
        assert type(caught.value).__name__ == f"FlashAttn{kind.__name__}", name

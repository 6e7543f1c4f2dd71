"""The public kernels as PyTorch operators: ``torch.ops.pagedflash.*``.

Every public entry point is one operator in the ``pagedflash`` namespace, defined here with its
schema (mutated tensors marked ``(a!)``) and a fake implementation that gives exact output shapes
and dtypes, so that ``torch.compile(fullgraph=True)`` traces code calling pagedflash without a
graph break, with static or dynamic (SymInt) shapes, under any backend (``aot_eager``, Inductor,
``mode="reduce-overhead"``'s CUDA graphs):

=============================== ================================================ ============================
operator                        public function                                  mutates
=============================== ================================================ ============================
``flash_attn_func``             :func:`pagedflash.flash_attn_func`               ``out``
``flash_attn_varlen_func``      :func:`pagedflash.flash_attn_varlen_func`        ``out``
``flash_attn_with_kvcache``     :func:`pagedflash.flash_attn_with_kvcache`       ``k_cache``, ``v_cache``, ``out``
``merge_attn_states``           :func:`pagedflash.merge_attn_states`             —
``write_kv_cache``              :func:`pagedflash.write_kv_cache`                ``k_cache``, ``v_cache``
``rms_norm``                    :func:`pagedflash.ops.norm.rms_norm`             —
``rope_``                       :func:`pagedflash.ops.rope.rope_`                ``x``
``silu_mul``                    :func:`pagedflash.ops.activation.silu_mul`       —
``gelu_tanh_mul``               :func:`pagedflash.ops.activation.gelu_tanh_mul`  —
``argmax``                      :func:`pagedflash.ops.sampling.argmax`           —
``gemv``                        :func:`pagedflash.ops.gemv.gemv` and its fused   ``out``
                                forms (``rms_norm_gemv``, ``silu_mul_gemv``,
                                ``gelu_tanh_mul_gemv``)
``moe_route``                   :func:`pagedflash.ops.moe.route`                 —
``fused_moe``                   :func:`pagedflash.ops.moe.fused_moe`             ``out``
``matmul``                      :func:`pagedflash.ops.matmul.matmul`             ``out``
=============================== ================================================ ============================

The operators take the arguments the public functions have already checked and normalized
(``window_size`` as two ints, the output preallocated): call the public functions, which check
their inputs first. Under ``torch.compile`` those checks run at trace time on fake tensors and
SymInts; the ones that read device values (``cu_seqlens`` monotone, page ids in the pool, ...) are
skipped there, as they are under CUDA-graph capture (:func:`pagedflash.validate.value_checks_enabled`).
The attention operators return the LSE, or an empty fp32 tensor without ``return_lse``; their
output is the mutated ``out``. An operator's result may not alias an input, so where a function
returns an input (``rms_norm`` without a residual returns ``x`` as the residual stream) the
operator returns an empty tensor there and the function substitutes the input.

Each kernel module binds its launcher to its operator with :func:`implement`, which returns the
function the public entry point calls: the operator while Dynamo traces, the launcher itself in
eager mode. Both run the same launcher on the same arguments, so results are bit-identical; the
test suite passes either way (``PAGEDFLASH_EAGER_OPS=1`` or :func:`dispatch_eager` routes eager
calls through the dispatcher too). Either way the launcher runs on the GPU of its first tensor
argument (Triton launches on the current device; flash-attn guards the device the same way), so a
call with tensors on ``cuda:1`` works while ``cuda:0`` is current.

Why this design, measured on the development machine (CPU, torch 2.13, ``timeit`` over 10^4 calls
of an operator with a trivial body and the decode operator's 15 arguments, best of 5, under
``torch.inference_mode``/``no_grad``, ranges over repeated runs on a shared machine; a
``torch.add_`` costs 5–7 µs there, as on the H200's host):

====================================================================== ==========
per-call cost of reaching a trivial body                               µs
====================================================================== ==========
direct Python call                                                     0.1–0.2
``torch.compiler.is_compiling()`` (the eager route's operator check)   0.14–0.24
``torch.library.Library.define`` + ``impl`` (used here)                5.4–9.6
``torch.library.custom_op`` with ``mutates_args``                      33–57
``torch.library.custom_op``, functional (returns a new tensor)         20–22
``torch.library.triton_op`` (a ``custom_op`` underneath)               58–75
====================================================================== ==========

- **Opaque operator, not** ``triton_op``. ``triton_op`` lets Inductor trace into the body and call
  the Triton kernels itself, but the body must then be traceable on fake tensors: the launcher's
  host logic is not (a compile failure retried with a safe tile, device-side TMA descriptors with a
  Triton allocator, launch plans keyed on pointer alignment, the fast relaunch path), and under the
  CPU interpreter no ``triton_op`` compiles at all (a five-line add kernel fails under both
  ``aot_eager`` and Inductor: the interpreter reads data pointers), so CI could not test it.
  Inductor could not fuse anything into a whole attention kernel anyway, and ``triton_op``'s eager
  dispatch is the slowest measured. What it would save, the Python launch in compiled code, CUDA
  graphs (``mode="reduce-overhead"``) already remove.
- **``Library.define`` rather than ``custom_op``**: the same operator for ``torch.compile``
  (schema, fake kernel, functionalization of the mutated arguments), at a seventh of the dispatch
  cost, which compiled graphs outside CUDA graphs pay on every call.
- **Eager calls skip the dispatcher**: even its 6–9 µs is a third of SDPA's whole eager call (about
  20 µs on the H200), against issue 14's target of 2.5× SDPA for ours; ``is_compiling()`` costs
  0.2 µs, and with several GPUs visible the device check (:func:`on_device_of`: the tensor's GPU
  index against the current one, a no-op context when they agree) about as much again.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from pagedflash.ops import scratch
from pagedflash.ops.utils import on_device

_lib = torch.library.Library("pagedflash", "DEF")

_ATTENTION_OPTIONS = "float? softmax_scale, int window_left, int window_right, float softcap"
# attention sinks (fp32 [Hq]) and the descales of fp8 K/V (fp32 [Hkv] or one value), all optional
_SIDE_INPUTS = "Tensor? sinks=None, Tensor? k_descale=None, Tensor? v_descale=None"
_SCHEMAS = {
    "flash_attn_func": f"(Tensor q, Tensor k, Tensor v, Tensor(a!) out, {_ATTENTION_OPTIONS}, bool return_lse, "
                       "Tensor? sinks=None, bool batch_invariant=False) -> Tensor",
    "flash_attn_varlen_func": "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                              "SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? block_table, Tensor(a!) out, "
                              f"{_ATTENTION_OPTIONS}, int num_splits, bool return_lse, {_SIDE_INPUTS}, "
                              "bool batch_invariant=False) -> Tensor",
    "flash_attn_with_kvcache": "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
                               "Tensor? cache_seqlens, Tensor? block_table, SymInt max_seqlen_k, Tensor(c!) out, "
                               f"{_ATTENTION_OPTIONS}, int num_splits, bool return_lse, {_SIDE_INPUTS}, "
                              "bool batch_invariant=False) -> Tensor",
    "merge_attn_states": "(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)",
    "write_kv_cache": "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
                      "Tensor? k_scale=None, Tensor? v_scale=None) -> ()",
    "rms_norm": "(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)",
    "rope_": "(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, int num_heads, int head_dim, "
             "int rotary_dim, Tensor? q_norm_weight=None, Tensor? k_norm_weight=None, int num_q_heads=0, "
             "float eps=0.0) -> ()",
    "silu_mul": "(Tensor gate_up) -> Tensor",
    "gelu_tanh_mul": "(Tensor gate_up) -> Tensor",
    "argmax": "(Tensor logits) -> Tensor",
    "gemv": "(Tensor x, Tensor weight, Tensor? bias, Tensor? residual, Tensor? norm_weight, float eps, "
            "int prologue, Tensor(a!) out) -> Tensor",
}
_RETURNS_LSE = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")
for _name, _schema in _SCHEMAS.items():
    _lib.define(_name + _schema)


def _lse(q: torch.Tensor, return_lse: bool, shape) -> torch.Tensor:
    return q.new_empty(shape if return_lse else (0,), dtype=torch.float32)


def _fake_dense(q, k, v, out, softmax_scale, window_left, window_right, softcap, return_lse, sinks=None,
                batch_invariant=False):
    return _lse(q, return_lse, (q.shape[0], q.shape[2], q.shape[1]))


def _fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, out,
                 softmax_scale, window_left, window_right, softcap, num_splits, return_lse, sinks=None,
                 k_descale=None, v_descale=None, batch_invariant=False):
    return _lse(q, return_lse, (q.shape[1], q.shape[0]))


def _fake_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, max_seqlen_k, out,
                  softmax_scale, window_left, window_right, softcap, num_splits, return_lse, sinks=None,
                  k_descale=None, v_descale=None, batch_invariant=False):
    return _lse(q, return_lse, (q.shape[0], q.shape[2], q.shape[1]))


def _fake_merge(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(out_a.shape[:-1])


def _fake_write(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    return None


def _fake_rms_norm(x, weight, eps, residual):
    return x.new_empty(x.shape), x.new_empty(x.shape if residual is not None else (0,))


def _fake_rope(x, positions, cos, sin, num_heads, head_dim, rotary_dim, q_norm_weight=None, k_norm_weight=None,
               num_q_heads=0, eps=0.0):
    return None


def _fake_act_mul(gate_up):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _fake_argmax(logits):
    return logits.new_empty(logits.shape[:1], dtype=torch.int64)


def _fake_gemv(x, weight, bias, residual, norm_weight, eps, prologue, out):
    return x.new_empty(x.shape if residual is not None else (0,))


for _name, _fake in (("flash_attn_func", _fake_dense), ("flash_attn_varlen_func", _fake_varlen),
                     ("flash_attn_with_kvcache", _fake_kvcache), ("merge_attn_states", _fake_merge),
                     ("write_kv_cache", _fake_write), ("rms_norm", _fake_rms_norm), ("rope_", _fake_rope),
                     ("silu_mul", _fake_act_mul), ("gelu_tanh_mul", _fake_act_mul), ("argmax", _fake_argmax), ("gemv", _fake_gemv)):
    torch.library.register_fake(f"pagedflash::{_name}", _fake, lib=_lib)

# moe_route (pagedflash.ops.moe.route): new (weights fp32, ids int32) [T, top_k]; scoring: an index of SCORINGS
_SCHEMAS["moe_route"] = "(Tensor router_logits, Tensor? bias, int top_k, int scoring, bool renormalize) -> (Tensor, Tensor)"
_lib.define("moe_route" + _SCHEMAS["moe_route"])


def _fake_moe_route(router_logits, bias, top_k, scoring, renormalize):
    shape = (router_logits.shape[0], top_k)
    return router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int32)


torch.library.register_fake("pagedflash::moe_route", _fake_moe_route, lib=_lib)

# fused_moe (pagedflash.ops.moe.fused_moe): writes out
_SCHEMAS["fused_moe"] = ("(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
                         "Tensor? w13_bias, Tensor? w2_bias, int activation, float alpha, float limit, "
                         "Tensor(a!) out, bool batch_invariant=False) -> ()")
_lib.define("fused_moe" + _SCHEMAS["fused_moe"])


def _fake_fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation, alpha, limit, out,
                    batch_invariant=False):
    return None


torch.library.register_fake("pagedflash::fused_moe", _fake_fused_moe, lib=_lib)

# matmul (pagedflash.ops.matmul.matmul, batch-invariant x @ weight.T + bias): writes out
_SCHEMAS["matmul"] = "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out, str act=\"\") -> ()"
_lib.define("matmul" + _SCHEMAS["matmul"])


def _fake_matmul(x, weight, bias, out, act=""):
    return None


torch.library.register_fake("pagedflash::matmul", _fake_matmul, lib=_lib)

_eager_via_ops = os.environ.get("PAGEDFLASH_EAGER_OPS", "0") == "1"


def dispatch_eager(enabled: bool) -> bool:
    """Route eager calls through ``torch.ops.pagedflash`` too (tests run both ways); returns the
    previous setting. Off by default: the dispatcher costs 6–9 µs per call (see the module doc)."""
    global _eager_via_ops
    previous, _eager_via_ops = _eager_via_ops, bool(enabled)
    return previous


def via_operator() -> bool:
    """Whether a call goes through ``torch.ops.pagedflash`` now: while Dynamo traces, or when eager
    calls are routed there (:func:`dispatch_eager`)."""
    return _eager_via_ops or torch.compiler.is_compiling()


def implement(name: str, launch: Callable) -> Callable:
    """Bind ``launch`` (the operator's arguments, in schema order) to ``torch.ops.pagedflash.<name>``;
    return the callable the public function uses: the operator while compiling, else ``launch``.

    Keyword arguments of the returned callable are hints for the launcher that the schema does not
    carry (an attention launcher's plan key, :func:`pagedflash.ops.attention_plan.public_plan_key`):
    passed to an eager launch, dropped through the operator, so a launcher gives the same result
    without them.

    A launcher returns None for a result it does not make (an attention launcher's LSE without
    ``return_lse``, ``rms_norm``'s residual stream without a residual); the operator returns an
    empty tensor there (fp32 for an LSE, else the first argument's dtype), as schemas have no
    optional results."""
    if name not in _SCHEMAS:
        raise ValueError(f"name: expected one of {sorted(_SCHEMAS)}, got {name!r}")
    returns = _SCHEMAS[name].rsplit("->", 1)[1].strip()
    empty_dtype = torch.float32 if name in _RETURNS_LSE else None

    out_index = _OUT_ARG.get(name)

    def kernel(*args):
        if out_index is not None:
            _check_out(args[0], args[out_index])
        with scratch.no_reuse():  # compiled graphs own every buffer a call leaves (scratch's doc)
            result = on_device_of(args[0], launch, args)
        if returns == "Tensor" and result is None:
            return args[0].new_empty((0,), dtype=empty_dtype or args[0].dtype)
        if isinstance(result, tuple):
            return tuple(args[0].new_empty((0,)) if r is None else r for r in result)
        return result

    _lib.impl(name, kernel, "CompositeExplicitAutograd")
    op = getattr(torch.ops.pagedflash, name).default

    def call(*args, **hints):  # via_operator() and on_device_of() inline: this runs on every eager call
        if _eager_via_ops or torch.compiler.is_compiling():
            return op(*args)
        first = args[0]
        if first.is_cuda and _several_gpus():
            with on_device(first.get_device()):
                return launch(*args, **hints)
        return launch(*args, **hints)

    call.__name__ = call.__qualname__ = name
    return call


def launches_here(first: torch.Tensor) -> bool:
    """Whether an eager call (one that :func:`implement`'s callable would not send to the operator:
    for a caller that knows Dynamo is not tracing it) may run its launcher itself, as that callable
    does: eager calls not routed through the dispatcher (:func:`dispatch_eager`), and no device to
    make current (``first`` not on a GPU, or one GPU visible)."""
    return not _eager_via_ops and not (first.is_cuda and _several_gpus())


# where the attention operators take ``out``, which they write in q's shape
_OUT_ARG = {"flash_attn_func": 3, "flash_attn_varlen_func": 8, "flash_attn_with_kvcache": 8}


def _check_out(q: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` of an attention operator called directly (``torch.ops.pagedflash.*``, or a compiled
    graph): q's shape, dtype and device, last dim contiguous. Host-side and cheap: the kernels write
    ``out`` by q's geometry, so any other tensor would be written past its end or wrongly."""
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or (out.numel() and out.stride(-1) != 1):
        raise ValueError(f"out: expected q's shape {tuple(q.shape)}, dtype {q.dtype} and device {q.device} with its "
                         f"last dim contiguous, got shape {tuple(out.shape)}, dtype {out.dtype}, device {out.device}, "
                         f"strides {out.stride()}")


def on_device_of(first: torch.Tensor, launch: Callable, args: tuple):
    """``launch(*args)`` with ``first``'s GPU current (with one GPU visible it always is)."""
    if first.is_cuda and _several_gpus():
        with on_device(first.get_device()):
            return launch(*args)
    return launch(*args)


_gpus: int | None = None  # visible GPUs, counted at the first call with a GPU tensor


def _several_gpus() -> bool:
    """Whether more than one GPU is visible. Asked only once a GPU tensor exists, when CUDA is
    initialized and the count is fixed for the process."""
    global _gpus
    if _gpus is None:
        _gpus = torch.cuda.device_count()
    return _gpus > 1

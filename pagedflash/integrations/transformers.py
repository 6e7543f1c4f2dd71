"""``attn_implementation="pagedflash"`` for Hugging Face ``transformers`` models.

    import pagedflash.integrations.transformers as pf_hf
    pf_hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pagedflash")

Registers :func:`pagedflash_attention_forward` with ``transformers.AttentionInterface`` and, with
``transformers.AttentionMaskInterface``, the mask function of the flash-attention path: it hands the
attention either ``None`` (no padding: dense causal :func:`pagedflash.flash_attn_func`) or the 2D
padding mask ``[B, Sk]``, from which the sequences are unpadded into one
:func:`pagedflash.flash_attn_varlen_func` launch. Prefill and decode work with transformers' own
caches (keys arrive with the past prepended; causal masking is bottom-right aligned). Inference only.
A padded row's real tokens must be contiguous and end with its queries (left padding, or right
padding in a prefill).

Under ``torch.compile`` nothing is read on the host (each read would be a graph break): the mask
function hands over the 2D mask whenever there is one, padding or not; a padded batch stays padded
and goes to one :func:`pagedflash.flash_attn_with_kvcache` launch of B rows, each row's keys gathered
real-first and its queries real-last (:func:`_padded`: a copy of q, k, v and the output, about what
eager's unpadding copies, paid for an all-real mask too); a packed row is cut by its positions into
one varlen segment per token, most of them empty (:func:`_position_segments`), or by transformers'
``cu_seq_lens_q/k`` with its ``max_length_q/k`` (the row's length when it passes none). Eager keeps
the paths above and reads the lengths transformers did not pass; results agree to rounding
(tests/test_compile.py, tests/test_transformers_integration.py).

Nothing is dropped silently. Every keyword transformers passes to an attention function is either
used (``scaling``, ``sliding_window`` as flash-attn's ``(w - 1, w - 1)`` window, ``softcap``,
``is_causal``, gpt-oss's attention sinks ``s_aux`` (one learned logit per query head in the softmax
denominator, passed to the kernels as ``sinks``), a packed row's ``cu_seq_lens_q/k`` or
``position_ids``), known to leave attention's math alone (``use_cache``, ``output_hidden_states``,
...), or refused with an error that names it: ``dropout > 0``, sinks under another name than
``s_aux`` (``sinks``, ``learnable_sink``: no transformers model passes them, so their meaning is
not known here), ALiBi slopes, a ``head_mask``, an additive ``position_bias``,
``output_attentions=True`` (no weights are formed), transformers' paged continuous-batching cache
(``block_table``, ``k_cache``, ...), and any keyword this module does not know (read from the call
sites and the ``TransformersKwargs``/``FlashAttentionKwargs`` of transformers 5.17 and 5.24) whose
value is not None or False.

Two private hooks, as transformers has no public ones for them
(tests/test_transformers_integration.py checks both against the installed transformers):

- transformers decides "is this flash attention?" by a substring test on the name (``"flash" in
  attn_implementation``) and then, at model init, tries to import a flash-attn package or hub
  kernel of that name, which fails for ``"pagedflash"``. :func:`register` therefore wraps
  ``transformers.modeling_utils.lazy_import_flash_attention`` so that it skips the names registered
  here and defers to the original for every other name.
- models with attention sinks (gpt-oss and others that pass ``s_aux``) list the flash kernels that
  run sinks in ``_compatible_flash_implementations``, and at load time transformers swaps any other
  flash-named implementation for the first of them. pagedflash runs sinks, so :func:`register` wraps
  ``PreTrainedModel._check_and_adjust_attn_implementation``: where a model instance's list names a
  sink-capable kernel (:data:`_SINK_KERNELS`), it gains our names (other models are left alone).

Routing through transformers' own flash-attention forward instead (its ``attention_wrapper`` hook)
would not do: it drops keywords the kernel's signature lacks, ``s_aux`` among them, without a word.
"""

from __future__ import annotations

import torch

from pagedflash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

NAME = "pagedflash"
_MASK_SOURCE = "flash_attention_2"  # transformers' mask function for unpadded kernels

# Keywords pagedflash reads itself (beyond the named parameters of pagedflash_attention_forward).
_USED = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "s_aux"})
# Keywords that do not change attention's output: caching and output bookkeeping of the model around it.
_NO_EFFECT = frozenset({
    "use_cache", "cache_position", "past_key_values", "past_key_value", "position_embeddings", "layer_idx",
    "output_hidden_states", "output_router_logits", "num_items_in_batch", "seq_idx", "deterministic",
    "target_dtype", "attn_implementation",
})
# Keywords that change the math and are not implemented: refused by name, whatever their value but None/False.
_UNSUPPORTED = {
    "sinks": "attention sinks are read only as s_aux (gpt-oss's keyword), whose meaning is known",
    "learnable_sink": "attention sinks are read only as s_aux (gpt-oss's keyword), whose meaning is known",
    "alibi_slopes": "ALiBi is not implemented",
    "head_mask": "head masks are not implemented",
    "position_bias": "an additive position bias on the scores is not implemented",
    "output_attentions": "the attention weights are never formed (use attn_implementation='eager' for them)",
    "block_table": "transformers' paged continuous-batching cache is not supported",
    "k_cache": "transformers' paged continuous-batching cache is not supported",
    "v_cache": "transformers' paged continuous-batching cache is not supported",
    "cache_seqlens": "transformers' paged continuous-batching cache is not supported",
    "use_top_left_mask": "top-left aligned causal masks are not implemented (pagedflash aligns bottom-right)",
}


def _refuse_unsupported(kwargs: dict) -> None:
    """Raise for a keyword that would change the attention and is not implemented (module doc)."""
    for name, value in kwargs.items():
        if name in _USED or name in _NO_EFFECT or value is None or value is False:
            continue
        shown = type(value).__name__ if isinstance(value, torch.Tensor) else repr(value)
        if name in _UNSUPPORTED:
            raise NotImplementedError(f"{name}: pagedflash attention got {name}={shown}, but {_UNSUPPORTED[name]}; "
                                      f"load this model with attn_implementation='sdpa' or 'eager'")
        raise TypeError(f"{name}: pagedflash attention got an unexpected keyword argument {name}={shown}; it may "
                        f"change the attention, so it is refused rather than ignored")


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` available to every transformers model (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    global _flash_mask_source
    AttentionInterface.register(name, pagedflash_attention_forward)
    if _flash_mask_source is None:
        _flash_mask_source = AttentionMaskInterface()[_MASK_SOURCE]
    AttentionMaskInterface.register(name, _flash_mask)
    _REGISTERED.add(name)
    _skip_flash_preload()
    _declare_sink_support()


_REGISTERED: set[str] = set()
# flash kernels that transformers' sink models list as compatible (they run s_aux); pagedflash does too
_SINK_KERNELS = ("flash_attention_4", "kernels-community/vllm-flash-attn3")
_flash_mask_source = None  # transformers' flash-attention mask function, read at the first register()


def _flash_mask(*args, **kwargs):
    """transformers' flash-attention mask function (``None`` without padding, else the 2D mask), except
    while ``torch.compile`` traces: there it returns the 2D mask sliced to ``kv_length`` whatever it
    holds, as deciding "no padding" reads the mask (``mask.all()``: a graph break in transformers); an
    all-real mask then takes the padded path of :func:`pagedflash_attention_forward`, same result."""
    mask, kv_length = kwargs.get("attention_mask"), kwargs.get("kv_length")
    if torch.compiler.is_compiling() and not args and mask is not None and kv_length is not None:
        return mask[:, -kv_length:]
    return _flash_mask_source(*args, **kwargs)


def _skip_flash_preload() -> None:
    """Keep transformers from importing a flash-attn package for our names (see the module doc)."""
    import transformers.modeling_utils as mu

    original = getattr(mu, "lazy_import_flash_attention", None)
    if original is None or getattr(original, "_pagedflash_wrapped", False):
        return

    def lazy_import_flash_attention(implementation, *args, **kwargs):
        if implementation in _REGISTERED:
            return None
        return original(implementation, *args, **kwargs)

    lazy_import_flash_attention._pagedflash_wrapped = True
    lazy_import_flash_attention.__wrapped__ = original
    mu.lazy_import_flash_attention = lazy_import_flash_attention


def _declare_sink_support() -> None:
    """Keep transformers from replacing our names by a hub kernel on models with sinks (module doc)."""
    from transformers import PreTrainedModel

    original = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if original is None or getattr(original, "_pagedflash_wrapped", False):
        return

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        listed = getattr(self, "_compatible_flash_implementations", None)
        if (isinstance(attn_implementation, str) and attn_implementation in _REGISTERED and listed
                and attn_implementation not in listed and any(k in listed for k in _SINK_KERNELS)):
            self._compatible_flash_implementations = [*listed, attn_implementation]
        return original(self, attn_implementation, *args, **kwargs)

    _check_and_adjust_attn_implementation._pagedflash_wrapped = True
    _check_and_adjust_attn_implementation.__wrapped__ = original
    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation


def pagedflash_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, Sq, D]
    key: torch.Tensor,  # [B, Hkv, Sk, D]
    value: torch.Tensor,  # [B, Hkv, Sk, D]
    attention_mask: torch.Tensor | None,  # None or bool/int [B, Sk] (1 = real token)
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The transformers attention-function contract; returns ``([B, Sq, Hq, D], None)``."""
    if dropout:
        raise ValueError(f"dropout: pagedflash attention is inference-only, expected 0.0 (call model.eval()), "
                         f"got {dropout}")
    _refuse_unsupported(kwargs)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attention_mask: pagedflash attention takes no mask or a 2D padding mask [B, Sk], got "
                         f"shape {tuple(attention_mask.shape)}")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    # transformers' flash-attention convention: w - 1 keys each side (causal keeps the left side only)
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    s_aux = kwargs.get("s_aux")  # gpt-oss's attention sinks, [Hq]
    opts = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap,
                sinks=None if s_aux is None else s_aux.float())
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D]
    if attention_mask is not None:
        if torch.compiler.is_compiling():  # nothing read on the host: static shapes, no graph break
            return _padded(q, k, v, attention_mask.bool(), opts), None
        if attention_mask.shape[1] != k.shape[1] or not bool(attention_mask.all()):
            return _varlen(q, k, v, attention_mask.bool(), opts), None
    packed = _packed_cu_seqlens(q, k, kwargs)
    if packed is not None:  # padding-free batch: several sequences packed in one row
        cu_q, cu_k, max_q, max_k = packed
        return flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, **opts)[None], None
    return flash_attn_func(q, k, v, **opts), None  # strided views: only the last dim must be contiguous


def _max_length(given, cu: torch.Tensor, bound: int):
    """A packed row's longest sequence: transformers' ``max_length_q/k`` when it passed an int, else
    ``bound`` (the row's length, an upper bound read from shapes) while compiling, else read from cu."""
    if isinstance(given, int) and not isinstance(given, bool):
        return given
    if torch.compiler.is_compiling():
        return bound
    return int((cu[1:] - cu[:-1]).max())


def _packed_cu_seqlens(q, k, kwargs) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of a packed row: from
    transformers' ``cu_seq_lens_q/k`` kwargs (padding-free collators), or from ``position_ids``
    restarting at 0 within a single row (a sequence starts at index 0 and wherever a position is 0)."""
    if q.shape[0] != 1:
        return None
    if kwargs.get("cu_seq_lens_q") is not None:
        cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
        cu_k = cu_q if kwargs.get("cu_seq_lens_k") is None else kwargs["cu_seq_lens_k"].to(torch.int32)
        max_q = _max_length(kwargs.get("max_length_q"), cu_q, q.shape[1])
        max_k = _max_length(kwargs.get("max_length_k"), cu_k, k.shape[1])
        return cu_q, cu_k, max_q, max_k
    pos = kwargs.get("position_ids")
    n = q.shape[1]
    if pos is None or n != k.shape[1] or n < 2 or pos.numel() != n:  # one position per token only
        return None
    pos = pos.reshape(-1).to(q.device)
    if torch.compiler.is_compiling():
        cu = _position_segments(pos)
        return cu, cu, n, n
    starts = pos == 0
    starts[0] = True
    starts = starts.nonzero().flatten()  # a sync: eager only
    if starts.numel() < 2:
        return None  # a single sequence: the dense kernel
    cu = torch.cat([starts, starts.new_tensor([n])]).to(torch.int32)
    max_len = _max_length(None, cu, n)
    return cu, cu, max_len, max_len


def _position_segments(pos: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` ``[S + 1]`` of a packed row from its positions, with no host read (compiled code):
    segment j holds the whole sequence that ends at token j and is empty unless token j ends one, so
    entry j < S is the start of the sequence holding token j (the last i <= j with ``pos[i] == 0``, or
    0) and entry S is S. Same sequences as the eager path finds; the cost of the static form is S
    segments, each one at least one (mostly empty, short-lived) program of the varlen grid."""
    n = pos.shape[0]
    idx = torch.arange(n, device=pos.device, dtype=torch.int32)
    start = torch.where(pos == 0, idx, torch.zeros_like(idx)).cummax(0).values
    return torch.cat([start, idx.new_full((1,), n)])


def _padded_layout(mask: torch.Tensor, sq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each row's real tokens are, from a ``[B, Sk]`` bool padding mask, without a host read.

    A row's real tokens are contiguous; its queries are its last ``sq`` positions (all of them real
    when ``sq > Sk``, as in :func:`_varlen`). Returns int64 ``[B]`` tensors: ``lead_k`` pad keys
    before the first real one (Sk if none), ``real_k`` real keys, and likewise ``lead_q`` and
    ``real_q`` for the queries."""
    sk = mask.shape[1]
    tokens = mask.to(torch.int32)
    lead_k = (tokens.cumsum(-1) == 0).sum(-1)
    real_k = tokens.sum(-1, dtype=torch.int64)
    if sq > sk:
        return lead_k, real_k, torch.zeros_like(lead_k), torch.full_like(lead_k, sq)
    lead_q = (lead_k - (sk - sq)).clamp(0, sq)
    return lead_k, real_k, lead_q, (lead_k + real_k - (sk - sq)).clamp(0, sq) - lead_q


def _padded(q, k, v, mask: torch.Tensor, opts: dict) -> torch.Tensor:
    """A padded batch with static shapes and no host read (the compiled path), in one
    :func:`pagedflash.flash_attn_with_kvcache` launch of B rows.

    Each row's keys are gathered so that its real ones come first (``cache_seqlens`` = their count),
    and its queries so that the real ones come last: bottom-right alignment then puts real query i of
    r_q at key position ``r_k - r_q + i``, as in the unpadded launch (in a causal prefill the pad
    queries then see no key). The output is gathered back and pad queries are zeroed. A batch of B rows, not a
    varlen launch of padding segments, so the launch plan (tile, KV split count) is that of B rows.
    Costs one copy of q (Sq > 1), k, v and the output; a row without real keys gets one (pad) key so
    no launch row has an empty cache (its outputs are all pads)."""
    b, sq = q.shape[:2]
    sk = mask.shape[1]
    lead_k, real_k, lead_q, real_q = _padded_layout(mask, sq)
    rows = torch.arange(b, device=q.device)[:, None]
    keys = (torch.arange(sk, device=q.device) + lead_k[:, None]) % sk  # real keys first
    k, v = k[rows, keys], v[rows, keys]  # [B, Sk, Hkv, D]; a static cache may be longer than the mask
    positions = torch.arange(sq, device=q.device)
    shift = sq - lead_q - real_q  # trailing pad queries
    if sq > 1:  # (one query: the shift is 0 or 1, the identity either way)
        q = q[rows, (positions - shift[:, None]) % sq]  # real queries last
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=real_k.clamp(min=1).to(torch.int32), **opts)
    if sq > 1:
        out = out[rows, (positions + shift[:, None]) % sq]
    real = (positions >= lead_q[:, None]) & (positions < (lead_q + real_q)[:, None]) & (real_k > 0)[:, None]
    return out.masked_fill(~real[:, :, None, None], 0)


def _varlen(q, k, v, mask: torch.Tensor, opts: dict) -> torch.Tensor:
    """Unpad by the 2D mask (real tokens of a row must be contiguous and end with its queries, as with
    left padding, or right padding in a prefill), run one varlen launch, pad the output back."""
    b, sq = q.shape[:2]
    sk = mask.shape[1]
    k, v = k[:, :sk], v[:, :sk]  # a static cache may be longer than the mask
    q_mask = mask[:, -sq:] if sq <= sk else torch.ones(b, sq, dtype=torch.bool, device=mask.device)
    seqlens_q = q_mask.sum(-1, dtype=torch.int32)
    seqlens_k = mask.sum(-1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_q = torch.cat([zero, seqlens_q.cumsum(0, dtype=torch.int32)])
    cu_k = torch.cat([zero, seqlens_k.cumsum(0, dtype=torch.int32)])
    max_q, max_k = torch.stack([seqlens_q.max(), seqlens_k.max()]).tolist()  # one sync for both
    out = flash_attn_varlen_func(q[q_mask], k[mask], v[mask], cu_q, cu_k, max_q, max_k, **opts)
    padded = q.new_zeros(q.shape)
    padded[q_mask] = out
    return padded

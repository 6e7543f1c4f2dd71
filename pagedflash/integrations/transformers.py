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

from pagedflash import flash_attn_func, flash_attn_varlen_func

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

    AttentionInterface.register(name, pagedflash_attention_forward)
    AttentionMaskInterface.register(name, AttentionMaskInterface()[_MASK_SOURCE])
    _REGISTERED.add(name)
    _skip_flash_preload()
    _declare_sink_support()


_REGISTERED: set[str] = set()
# flash kernels that transformers' sink models list as compatible (they run s_aux); pagedflash does too
_SINK_KERNELS = ("flash_attention_4", "kernels-community/vllm-flash-attn3")


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
    if attention_mask is not None and attention_mask.shape[1] == k.shape[1] and bool(attention_mask.all()):
        attention_mask = None
    if attention_mask is not None:
        return _varlen(q, k, v, attention_mask.bool(), opts), None
    cu = _packed_cu_seqlens(q, k, kwargs)
    if cu is not None:  # padding-free batch: several sequences packed in one row
        cu_q, cu_k = cu
        lens_q, lens_k = torch.stack([(c[1:] - c[:-1]).max() for c in cu]).tolist()  # one sync
        return flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, lens_q, lens_k, **opts)[None], None
    return flash_attn_func(q, k, v, **opts), None  # strided views: only the last dim must be contiguous


def _packed_cu_seqlens(q, k, kwargs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(cu_seqlens_q, cu_seqlens_k)`` of a packed row: from transformers' ``cu_seq_lens_q/k`` kwargs
    (padding-free collators), or from ``position_ids`` restarting at 0 within a single row."""
    if q.shape[0] != 1:
        return None
    if kwargs.get("cu_seq_lens_q") is not None:
        cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
        return cu_q, kwargs.get("cu_seq_lens_k", cu_q).to(torch.int32)
    pos = kwargs.get("position_ids")
    if pos is None or q.shape[1] != k.shape[1] or q.shape[1] < 2:
        return None
    starts = (pos.reshape(-1) == 0).nonzero().flatten()
    if starts.numel() < 2:
        return None
    end = torch.tensor([q.shape[1]], device=starts.device)
    cu = torch.cat([starts, end]).to(device=q.device, dtype=torch.int32)
    return cu, cu


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

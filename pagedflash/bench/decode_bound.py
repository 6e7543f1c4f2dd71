"""The memory-bandwidth bound of a decode step (``bench serve``'s ``% of bound``): the bytes of weights
and K/V one step reads, over the HBM bandwidth per GPU (:func:`pagedflash.bench.hbm.hbm_bandwidth`:
the datasheet figure of the GPU the bench runs on).

Weights: every parameter once, in the model's dtype, but for an untied input embedding (a lookup
reads one row per token) and, in a mixture of experts, the experts no row of the step is routed to.
K/V: each layer's cached tokens, at most the window in a sliding-window layer.
"""

from __future__ import annotations

from pagedflash.bench.hbm import hbm_bandwidth


def bound_seconds(weight_bytes: float, kv_read: float, gpus: int = 1) -> float:
    """A decode step's bandwidth bound: the weights and ``kv_read`` bytes of K/V read once, spread
    over ``gpus`` GPUs at :func:`~pagedflash.bench.hbm.hbm_bandwidth` each."""
    return (weight_bytes + kv_read) / (gpus * hbm_bandwidth().tbps * 1e12)


def bytes_read(config, engine_kw: dict, on_gpu: bool, batch: int = 1) -> tuple[float, int]:
    """(weight bytes, KV bytes per cached token and layer) a decode step of ``batch`` rows reads: the
    model in bf16 on the GPU (fp32 on the CPU), the KV cache in that dtype or in fp8 (one byte) with
    ``--kv-cache-dtype``. Every parameter is read once per step (:func:`params_read`), but for an
    untied input embedding: its lookup reads one row per token, while the LM head reads its whole
    ``[vocab, hidden]`` matrix (a tied embedding is that matrix, counted once)."""
    itemsize = 2 if on_gpu else 4
    kv_itemsize = itemsize if engine_kw.get("kv_cache_dtype", "auto") == "auto" else 1
    params = params_read(config, batch)
    if not config.tie_word_embeddings:
        params -= config.vocab_size * config.hidden_size
    return params * itemsize, 2 * config.num_kv_heads * config.head_dim * kv_itemsize


def params_read(config, batch: int) -> float:
    """Parameters a decode step of ``batch`` rows reads. A dense model: all. A mixture of experts:
    all but the experts no row is routed to; a layer of E experts, k per token, reads E·(1 − (1 −
    k/E)^batch) of them in expectation under uniform routing (random weights route near uniformly),
    so batch 1 reads :meth:`~pagedflash.engine.ModelConfig.num_active_parameters`."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    total, e, k = config.num_parameters(), config.num_experts, config.num_experts_per_tok
    if not e or k >= e:
        return total
    experts = (total - config.num_active_parameters()) * e / (e - k)  # every expert of every MoE layer
    return total - experts * (1 - k / e) ** batch


def experts_note(config) -> str:
    """What a bound's weights count in a mixture of experts (nothing for a dense model)."""
    if not config.num_experts:
        return ""
    return (f" at batch 1: the routed {config.num_experts_per_tok} of {config.num_experts} experts; a batch of b "
            "rows the expected experts its tokens route to")


def kv_read(config, kv_bytes: int, context: float) -> float:
    """K/V bytes one sequence of ``context`` cached tokens reads in a decode step over all layers
    (``kv_bytes`` per token and layer): a sliding-window layer reads at most its window."""
    window = config.sliding_window or context
    return kv_bytes * sum(min(context, window) if config.is_sliding(i) else context for i in range(config.num_layers))

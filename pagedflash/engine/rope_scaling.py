"""RoPE as a Hugging Face config gives it: the theta and scaling read from either spelling (the older
``rope_theta`` + ``rope_scaling``, the newer ``rope_parameters``, Gemma 3's keyed by layer type), and
the inverse frequencies each scaling makes, as transformers computes them.

Supported types: ``default``, ``linear``, ``llama3``, ``longrope`` (``su``, its first name),
``yarn`` (static: GPT-OSS); any other fails the load by name. ``longrope`` (Phi-3): transformers
switches from the short to the long factors once a forward's sequence is longer than
``original_max_position_embeddings``; the engine takes one set for every position, the long one when
its ``max_model_len`` passes that length (then equal to transformers on sequences longer than it),
else the short one (then equal on every sequence).

Partial rotary (Phi-3's ``partial_rotary_factor``, :func:`rotary_dim`): the frequencies of every type
are those of a head ``int(head_dim * partial_rotary_factor)`` wide, as transformers computes them
(longrope's factor lists hold half that many numbers).
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def inv_freq(theta: float, scaling: dict, d: int, max_len: int = 0) -> torch.Tensor:
    """Inverse frequencies ``[d/2]`` fp32 on the CPU of a RoPE with ``theta`` and ``scaling`` (as
    :func:`rope_from_dict` completed it) over ``d`` rotated dims (the head's, or :func:`rotary_dim`'s
    with partial rotary); ``max_len``: the longest sequence served (longrope's choice of factors)."""
    # on the CPU whatever device is current (the model is built under its device, or meta)
    base = theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d)
    inv = 1.0 / base
    kind = scaling.get("rope_type", "default")
    if kind == "longrope":  # 1 / (factor * base), in transformers' order of operations
        long = max_len > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
        inv = 1.0 / (factors * base)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(is_medium, smoothed, scaled)
    elif kind == "yarn":
        inv = _yarn_inv_freq(base, d, theta, scaling)
    return inv


def partial_rotary_factor(d: dict) -> float:
    """The fraction of a head RoPE rotates, as transformers' Phi-3 config reads it: the RoPE dict's
    (``rope_scaling``, else ``rope_parameters``) ``partial_rotary_factor``, else the config's own key,
    else 1 (a ``None`` is 1 too). A number in ``(0, 1]``, else refused naming the key."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if value is None:
        value = d.get("partial_rotary_factor")
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"config.json: partial_rotary_factor must be a number in (0, 1], got {value!r}")
    return float(value)


def rotary_dim(d: dict) -> int:
    """The dims of each head RoPE rotates: ``int(head_dim * partial_rotary_factor)``, as transformers
    computes it (:func:`partial_rotary_factor`); an even number >= 2, else refused naming the key."""
    head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    factor = partial_rotary_factor(d)
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise ValueError(f"config.json: partial_rotary_factor={factor!r} rotates int(head_dim {head_dim} * "
                         f"{factor!r}) = {dim} dims of each head, expected an even number >= 2 (rotate-half pairs)")
    return dim


def _yarn_inv_freq(base: torch.Tensor, dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's inverse frequencies (``base``: ``theta ** (2i / dim)``), as transformers computes them:
    interpolated (divided by ``factor``) below the ``beta_slow`` rotations of the original context,
    extrapolated (kept) above ``beta_fast``, a linear ramp between."""
    original, factor = scaling["original_max_position_embeddings"], scaling["factor"]

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * base)) * (1 - extrapolation) + (1.0 / base) * extrapolation


def rope_from_dict(d: dict, arch: str, *, per_layer_type: bool, default_theta: float = 10000.0):
    """``((theta, scaling), local)`` from ``rope_parameters`` or ``rope_theta``/``rope_scaling``:
    ``local`` the sliding layers' ``(theta, scaling)`` where ``per_layer_type`` (Gemma 3: rope_parameters
    keyed by layer type, or the older ``rope_local_base_freq``), else None. Per-layer-type parameters
    for another family are refused. ``default_theta``: the family's theta when the config gives none."""
    if "rope_theta" not in d:
        d = {**d, "rope_theta": default_theta}
    params = d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: rope_parameters must be an object, got {params!r}")
    by_type = {k: v for k, v in params.items() if isinstance(v, dict)}
    if by_type:
        if not per_layer_type:
            raise ValueError(f"config.json: rope_parameters per layer type ({', '.join(by_type)}) are not "
                             f"implemented for {arch}, which has one RoPE")
        if set(by_type) - {"full_attention", "sliding_attention"} or "full_attention" not in by_type:
            raise ValueError(f"config.json: rope_parameters keyed by layer type must give 'full_attention' "
                             f"(and 'sliding_attention'), got {sorted(by_type)}")
        full = _one_rope(by_type["full_attention"], {}, d)
        local = by_type.get("sliding_attention")
        return full, (_one_rope(local, {}, d) if local is not None else full)
    full = _one_rope(params, d.get("rope_scaling") or {}, d)
    if per_layer_type:
        return full, (float(d.get("rope_local_base_freq") or 10000.0), {})
    return full, None


def _one_rope(params: dict, scaling: dict, d: dict) -> tuple[float, dict]:
    """(theta, scaling dict) of one RoPE: ``params`` (rope_parameters' spelling) over ``scaling``."""
    scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}  # (:func:`rotary_dim`)
    scaling.update({k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")})
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)):
        raise ValueError(f"config.json: rope_theta must be a number, got {theta!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "su":  # longrope's first name (Phi-3-128k's configs), as transformers reads it
        kind = "longrope"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind == "default":
        return float(theta), {}
    scaling["rope_type"] = kind
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if scaling.get(key) is None:
                raise ValueError(f"llama3 RoPE scaling needs {key!r}")
    elif kind == "longrope":
        _longrope(scaling, d)
    elif kind == "yarn":
        _yarn(scaling, d)
    elif "factor" not in scaling:
        raise ValueError(f"{kind} RoPE scaling needs 'factor'")
    return float(theta), scaling


def _yarn(scaling: dict, d: dict) -> None:
    """Complete a yarn ``scaling`` in place, as transformers' ``_compute_yarn_parameters`` reads it:
    ``original_max_position_embeddings`` (the config's own key first, else the scaling's, else
    ``max_position_embeddings``), ``factor`` (default: their ratio), ``attention_factor`` (default:
    ``0.1 ln(factor) + 1``, or the ratio of two such terms with ``mscale`` and ``mscale_all_dim``),
    ``beta_fast`` 32, ``beta_slow`` 1, ``truncate`` True."""
    original = (d.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                or d.get("max_position_embeddings"))
    if not original:
        raise ValueError("yarn RoPE scaling needs 'original_max_position_embeddings'")
    scaling["original_max_position_embeddings"] = int(original)
    factor = scaling.get("factor") or (d.get("max_position_embeddings") or original) / original
    scaling["factor"] = float(factor)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("attention_factor") is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        scaling["attention_factor"] = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    scaling["beta_fast"] = float(scaling.get("beta_fast") or 32)
    scaling["beta_slow"] = float(scaling.get("beta_slow") or 1)
    scaling["truncate"] = bool(scaling.get("truncate", True))


def _longrope(scaling: dict, d: dict) -> None:
    """Complete and check a longrope ``scaling`` in place, as transformers reads it: the factor lists,
    ``original_max_position_embeddings``, and ``attention_factor`` (default from ``factor``, itself by
    default ``max_position_embeddings / original_max_position_embeddings``). The factor lists hold
    one number per rotated pair (:func:`rotary_dim` / 2)."""
    # the config's own key first, as transformers reads it
    original = d.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    if not original:
        raise ValueError("longrope RoPE scaling needs 'original_max_position_embeddings'")
    scaling["original_max_position_embeddings"] = int(original)
    half = rotary_dim(d) // 2
    for key in ("short_factor", "long_factor"):
        value = scaling.get(key)
        if not isinstance(value, (list, tuple)) or len(value) != half:
            raise ValueError(f"longrope RoPE scaling needs {key!r}: {half} numbers (rotated dims / 2: head_dim "
                             f"times partial_rotary_factor, halved), got {value!r}")
    factor = scaling.get("factor") or (d.get("max_position_embeddings") or original) / original
    if scaling.get("attention_factor") is None:
        scaling["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

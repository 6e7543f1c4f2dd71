"""ModelConfig: the numbers and switches a decoder of a supported family needs, read from a Hugging
Face config.

Accepted sources: a local model directory (its ``config.json``), a ``transformers`` config object, or
a plain dict with HF keys; RoPE parameters in either spelling, read and computed by
:mod:`pagedflash.engine.rope_scaling` (which lists the supported scalings).

Strict reading: the architecture (``architectures``) picks a family (:data:`FAMILIES`), and a config
that asks for math the family does not do is refused, naming the key: a key of :data:`MATH_KEYS` set
to a value other than its neutral one that the family does not implement (Granite's multipliers or
Gemma's softcaps under ``LlamaForCausalLM``, say), a ``model_type`` of another family, per-layer RoPE
parameters where the family has one RoPE, an activation other than the family's, a
GPT-OSS ``quantization_config`` other than MXFP4 experts (:func:`_moe_fields`).

Keys a config leaves out mean what the family's transformers config class makes of them
(:mod:`pagedflash.engine.hf_defaults`, transformers 5.25's values: Mistral's 4096-token window,
Gemma's softcaps and ``query_pre_attn_scalar`` 256, Gemma 3's RoPE thetas 1e6 / 1e4, Granite's
``attention_multiplier`` 1.0, Qwen3's ``head_dim`` 128, ...); the engine does not import transformers.

Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE, GPT-OSS) set the
``num_experts`` fields: the router (:func:`pagedflash.ops.moe.route`'s ``scoring`` and
``renormalize``), the experts' activation and biases, a shared expert (Qwen2-MoE), and which layers
are dense (Qwen2/3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from pagedflash.engine import rope_scaling as rope
from pagedflash.engine.hf_defaults import READS_ATTENTION_BIAS, READS_LAYER_TYPES, READS_MLP_BIAS, complete
from pagedflash.engine.rope_scaling import SUPPORTED_ROPE_TYPES  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Family:
    """A decoder family: ``name`` (its module in :mod:`pagedflash.engine.models`), the ``model_type``
    values its checkpoints carry, and the :data:`MATH_KEYS` it implements."""

    name: str
    model_types: tuple[str, ...]
    keys: frozenset[str] = frozenset()


_GRANITE_KEYS = frozenset({"embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"})
_GEMMA_KEYS = frozenset({"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                         "hidden_activation"})
FAMILIES = {  # keyed by the HF ``architectures`` entry
    "LlamaForCausalLM": Family("llama", ("llama",)),
    "MistralForCausalLM": Family("mistral", ("mistral",)),
    "Qwen2ForCausalLM": Family("qwen2", ("qwen2",)),
    "Qwen3ForCausalLM": Family("qwen3", ("qwen3",)),
    "GraniteForCausalLM": Family("granite", ("granite",), _GRANITE_KEYS),
    "Olmo2ForCausalLM": Family("olmo2", ("olmo2",)),
    "Gemma2ForCausalLM": Family("gemma2", ("gemma2",), _GEMMA_KEYS),
    "Gemma3ForCausalLM": Family("gemma3", ("gemma3_text",), _GEMMA_KEYS | {"rope_local_base_freq"}),
    "Phi3ForCausalLM": Family("phi3", ("phi3",), frozenset({"partial_rotary_factor"})),
    "MixtralForCausalLM": Family("mixtral", ("mixtral",), frozenset({"num_local_experts", "num_experts"})),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", ("qwen2_moe",), frozenset(
        {"num_local_experts", "num_experts", "shared_expert_intermediate_size"})),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", ("qwen3_moe",), frozenset({"num_local_experts", "num_experts"})),
    "OlmoeForCausalLM": Family("olmoe", ("olmoe",), frozenset({"num_local_experts", "num_experts"})),
    # transformers' Granite-MoE reads num_local_experts only (no num_experts alias): another num_experts is refused
    "GraniteMoeForCausalLM": Family("granitemoe", ("granitemoe",), _GRANITE_KEYS | {"num_local_experts"}),
    "GptOssForCausalLM": Family("gpt_oss", ("gpt_oss",), frozenset({"num_local_experts", "num_experts"})),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss")
SUPPORTED_ARCHITECTURES = {arch: fam.name for arch, fam in FAMILIES.items()}
MODEL_TYPE_TO_ARCH = {t: arch for arch, fam in FAMILIES.items() for t in fam.model_types}
# architectures refused with a reason of their own
REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "Gemma 3 with its vision tower (image inputs) is not supported; "
                                      "a text-only Gemma3ForCausalLM checkpoint is",
    "GraniteMoeSharedForCausalLM": "Granite-MoE with a shared expert is not supported (GraniteMoeForCausalLM is)",
    "GraniteMoeHybridForCausalLM": "Granite's hybrid Mamba-attention models are not supported (no state-space layers)",
}

# HF config keys that change a decoder's math -> the values that leave it unchanged. A family that
# does not list a key in ``Family.keys`` refuses any other value.
MATH_KEYS = {
    "query_pre_attn_scalar": (None,),
    "attn_logit_softcapping": (None, 0, 0.0),
    "final_logit_softcapping": (None, 0, 0.0),
    "hidden_activation": (None,),
    "embedding_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "residual_multiplier": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
    "partial_rotary_factor": (None, 1, 1.0),  # transformers' families but Phi-3 ignore it or fail on it
    "rope_local_base_freq": (None,),
    "use_bidirectional_attention": (None, False),
    "clip_qkv": (None,),
    "qk_layernorm": (None, False),
    "use_qk_norm": (None, False),
    "attention_chunk_size": (None,),
    "no_rope_layers": (None,),
    "num_experts": (None, 0),
    "num_local_experts": (None, 0),
    "n_routed_experts": (None, 0),
    "shared_expert_intermediate_size": (None, 0),  # Qwen2-MoE's gated shared expert
    "n_shared_experts": (None, 0),
    "routed_scaling_factor": (None, 1, 1.0),
}
# Configs (HF keys) used by the demo, the serve benchmark and the GPU tests.
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
_LLAMA_3_1_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
LLAMA_3_8B = {  # Llama-3.1-8B's shape (the tensor-parallel benchmark)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "rope_scaling": _LLAMA_3_1_ROPE,
}
LLAMA_3_70B = {  # Llama-3.1-70B's shape: 141 GB of bf16 weights, more than one H200 holds with a KV pool
    **LLAMA_3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
}
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "eos_token_id": 2,
}
GEMMA_2_2B = {  # google/gemma-2-2b's config (the families' serve figures)
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304,
    "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "rope_theta": 10000.0, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    "attention_bias": False, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}
QWEN3_1_7B = {  # Qwen/Qwen3-1.7B's config
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "rope_theta": 1000000.0, "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
    "bos_token_id": 151643, "eos_token_id": 151645,
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., factor, ...}; empty = default
    partial_rotary_factor: float = 1.0  # the fraction of each head RoPE rotates (Phi-3): rotary_dim
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" or "sliding_attention"; () = all alike
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)
    initializer_range: float = 0.02
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    qk_norm: str = ""  # "" none; "head": RMSNorm over each head (Qwen3, Gemma 3); "projection": over all q / k (OLMo 2)
    norm_offset: float = 0.0  # norms scale by (offset + w): 1.0 for Gemma's (1 + w)
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # attention logits: cap * tanh(s / cap); 0: none
    final_softcap: float = 0.0  # LM logits likewise
    embedding_multiplier: float = 1.0  # the embedding's output times this (Granite; Gemma: sqrt(hidden))
    residual_multiplier: float = 1.0  # attention and MLP outputs times this before the residual add (Granite)
    logits_scaling: float = 1.0  # LM logits divided by this (Granite)
    local_rope_theta: float | None = None  # sliding layers' RoPE theta when it differs (Gemma 3)
    local_rope_scaling: dict = field(default_factory=dict)
    attention_sinks: bool = False  # a learned sink logit per query head (GPT-OSS)
    # mixture of experts (0 experts: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's; a dense layer's is intermediate_size
    moe_scoring: str = "softmax"  # pagedflash.ops.moe.route's scoring: "softmax" or "topk_softmax" (GPT-OSS)
    moe_renormalize: bool = True  # the top-k softmax weights divided by their sum
    moe_activation: str = "silu"  # fused_moe's: "silu" or "swigluoai" (GPT-OSS's clamped SwiGLU)
    moe_bias: bool = False  # router and expert biases (GPT-OSS)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP in a MoE model (Qwen2/3-MoE)
    shared_expert_intermediate_size: int = 0  # a shared expert beside the routed ones, gated per token (Qwen2-MoE)
    moe_quant: str = ""  # the checkpoint's expert weights: "" as the model's, "mxfp4" (GPT-OSS; dequantized at load)

    @property
    def family(self) -> str:
        """The family's module name in :mod:`pagedflash.engine.models`."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` for extra EOS ids) from a local directory."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} does not exist (nothing is fetched from a hub)")
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"model directory {path!r} has no config.json")
        with open(cfg_file) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{cfg_file} must hold a JSON object, got {type(d).__name__}")
        config = cls.from_dict(d)
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            with open(gen_file) as f:
                extra = _as_id_tuple(json.load(f).get("eos_token_id"))
            config.eos_token_ids = tuple(dict.fromkeys(config.eos_token_ids + extra))
        return config

    @classmethod
    def from_hf_config(cls, hf_config) -> ModelConfig:
        """From a ``transformers`` ``PretrainedConfig`` (only its public ``to_dict()``)."""
        return cls.from_dict(hf_config.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """From HF config keys. A key left out means what the family's transformers config class makes
        of it (:func:`pagedflash.engine.hf_defaults.complete`); vocab_size, hidden_size, intermediate_size, num_hidden_layers and
        num_attention_heads must be given."""
        arch = _architecture(d)
        kind = SUPPORTED_ARCHITECTURES[arch]
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(d.get(key), int) or d[key] < 1:
                raise ValueError(f"config.json: {key} must be a positive int, got {d.get(key)!r}")
        d = complete(d, kind)
        _check_math_keys(d, arch)
        num_heads = d["num_attention_heads"]
        num_kv_heads = d["num_key_value_heads"] or num_heads
        head_dim = d["head_dim"] or d["hidden_size"] // num_heads
        if not 16 <= head_dim <= 256:
            raise ValueError(f"head_dim={head_dim} is outside the attention kernels' range [16, 256]")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        gemma = kind in ("gemma2", "gemma3")
        act = d["hidden_activation"] if gemma else d["hidden_act"]  # Gemma's transformers ignores hidden_act
        wanted = ("gelu_pytorch_tanh",) if gemma else ("silu", "swish")
        if act not in wanted:
            raise ValueError(f"unsupported hidden_act {act!r} for {arch} (implemented: {', '.join(wanted)})")
        (theta, scaling), local = rope.rope_from_dict(d, arch, per_layer_type=kind == "gemma3",
                                                      default_theta=d["rope_theta"])
        attn_bias = kind in READS_ATTENTION_BIAS and bool(d["attention_bias"])
        sliding = d["sliding_window"]
        if kind in ("llama", "granite", "olmo2", "olmoe", "granitemoe") or (
                kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not d["use_sliding_window"]):
            sliding = None  # transformers ignores the key there; Qwen2/3 slide only when told to
        extra = _family_fields(kind, d, head_dim)
        if "partial_rotary_factor" in FAMILIES[arch].keys:
            rope.rotary_dim(d)  # checked: an even number of dims >= 2
            extra["partial_rotary_factor"] = rope.partial_rotary_factor(d)
        if local is not None and sliding:
            extra.update(local_rope_theta=local[0], local_rope_scaling=local[1])
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=_positive_int(d, "max_position_embeddings", d["max_position_embeddings"]),
            rms_norm_eps=_positive_float(d, "rms_norm_eps"),
            rope_theta=theta,
            rope_scaling=scaling,
            # Qwen2: q/k/v biases always, Qwen2-MoE by qkv_bias; o_proj none
            qkv_bias=True if kind == "qwen2" else bool(d["qkv_bias"]) if kind == "qwen2_moe" else attn_bias,
            o_bias=attn_bias,
            mlp_bias=kind in READS_MLP_BIAS and bool(d["mlp_bias"]),
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            sliding_window=int(sliding) if sliding else None,
            layer_types=_layer_types(d, kind) if sliding else (),
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            initializer_range=float(d["initializer_range"]),
            eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            **extra,
        )

    # ------------------------------------------------------------------ derived
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends within ``sliding_window`` (every layer, unless ``layer_types`` says)."""
        if not self.sliding_window:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def num_parameters(self) -> int:
        """Parameters of the family's model (norms and biases included; a tied head once), counted on
        the meta device: nothing is allocated."""
        from pagedflash.engine.models import model_class

        with torch.device("meta"):
            model = model_class(self)(self, 1)
        return sum(p.numel() for p in model.parameters())

    def num_active_parameters(self) -> int:
        """Parameters one token's forward reads: :meth:`num_parameters` less, in each mixture-of-experts
        layer, the experts it is not routed to (``num_experts - num_experts_per_tok`` of them)."""
        total = self.num_parameters()
        if not self.num_experts:
            return total
        h, i = self.hidden_size, self.moe_intermediate_size
        per_expert = 3 * h * i + ((2 * i + h) if self.moe_bias else 0)
        moe_layers = sum(self.is_moe(layer) for layer in range(self.num_layers))
        return total - moe_layers * (self.num_experts - self.num_experts_per_tok) * per_expert

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones): ``int(head_dim * partial_rotary_factor)``,
        as transformers computes it."""
        return int(self.head_dim * self.partial_rotary_factor)

    def inv_freq(self, local: bool = False, max_len: int = 0) -> torch.Tensor:
        """RoPE inverse frequencies ``[R/2]`` (``R``: :attr:`rotary_dim`) fp32 on the CPU, with the
        configured scaling (as transformers computes them); ``local``: the sliding layers'
        (``local_rope_theta``) where they differ; ``max_len``: the longest sequence served (longrope's
        choice of factors: :mod:`.rope_scaling`)."""
        theta, scaling = (self.local_rope_theta, self.local_rope_scaling) if local else \
            (self.rope_theta, self.rope_scaling)
        return rope.inv_freq(theta, scaling, self.rotary_dim, max_len)

    def rope_attention_factor(self, local: bool = False) -> float:
        """The factor on RoPE's cos and sin (longrope's ``attention_factor``; 1 otherwise)."""
        scaling = self.local_rope_scaling if local else self.rope_scaling
        return float(scaling.get("attention_factor", 1.0))


def _architecture(d: dict) -> str:
    """The supported architecture ``d`` names (``architectures``, else ``model_type``); a
    ``model_type`` of another family is refused (a relabelled checkpoint)."""
    archs = d.get("architectures") or []
    for a in archs:
        if a in REFUSED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {a}: {REFUSED_ARCHITECTURES[a]}")
    arch = next((a for a in archs if a in FAMILIES), None)
    model_type = d.get("model_type")
    if arch is None and not archs:
        arch = MODEL_TYPE_TO_ARCH.get(model_type or "")
    if arch is None:
        name = ", ".join(archs) if archs else f"model_type={model_type!r}"
        raise ValueError(f"unsupported architecture {name}; supported: {', '.join(FAMILIES)}")
    if model_type and model_type not in FAMILIES[arch].model_types:
        raise ValueError(f"config.json: model_type={model_type!r} does not belong to architecture {arch} "
                         f"(expected {' or '.join(map(repr, FAMILIES[arch].model_types))}): a checkpoint of "
                         "another family relabelled, whose math this architecture would get wrong")
    return arch


def _check_math_keys(d: dict, arch: str) -> None:
    """Refuse a key of :data:`MATH_KEYS` with a non-neutral value that ``arch`` does not implement,
    given at the top level or in a RoPE dict (``rope_parameters``, by layer type or not, ``rope_scaling``)."""
    implemented = FAMILIES[arch].keys
    sources = [d] + [v for v in (d.get("rope_parameters"), d.get("rope_scaling")) if isinstance(v, dict)]
    sources += [v for src in sources[1:] for v in src.values() if isinstance(v, dict)]
    for key, neutral in MATH_KEYS.items():
        if key in implemented:
            continue
        for value in (src.get(key) for src in sources):
            if not any(value is n or (n is not None and value == n) for n in neutral):
                raise ValueError(f"config.json: {key}={value!r} changes the model's math and is not implemented "
                                 f"for {arch} (pagedflash would compute another model)")


def _family_fields(kind: str, d: dict, head_dim: int) -> dict:
    """The :class:`ModelConfig` fields beyond a Llama's that family ``kind`` sets from ``d``."""
    if kind == "qwen3":
        return dict(qk_norm="head")
    if kind == "olmo2":
        return dict(qk_norm="projection")
    fields = {}
    if kind in ("granite", "granitemoe"):
        scale = d["attention_multiplier"]  # transformers: the softmax scale itself (default 1.0); None: 1/sqrt(D)
        fields.update({key: float(1.0 if d[key] is None else d[key])
                       for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling")})
        fields["attention_scale"] = None if scale is None else float(scale)
    if kind in MOE_FAMILIES:
        fields.update(_moe_fields(kind, d))
    if fields:
        return fields
    if kind in ("gemma2", "gemma3"):
        scalar = d["query_pre_attn_scalar"] or head_dim
        return dict(qk_norm="head" if kind == "gemma3" else "", norm_offset=1.0,
                    embedding_multiplier=float(d["hidden_size"]) ** 0.5, attention_scale=float(scalar) ** -0.5,
                    # transformers' Gemma 3 reads attn_logit_softcapping and never applies it
                    attn_softcap=float(d["attn_logit_softcapping"] or 0.0) if kind == "gemma2" else 0.0,
                    final_softcap=float(d["final_logit_softcapping"] or 0.0))
    return {}


def _positive_int(d: dict, key: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json: {key} must be a positive int, got {value!r}")
    return value


def _positive_float(d: dict, key: str) -> float:
    value = d[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


def _moe_fields(kind: str, d: dict) -> dict:
    """The mixture-of-experts fields of :data:`MOE_FAMILIES`, as transformers reads them:
    Mixtral softmax then renormalized top-k, SiLU experts of ``intermediate_size``; Qwen2/3-MoE the same
    with ``norm_topk_prob`` (renormalize or not) and experts of ``moe_intermediate_size``, dense MLPs in
    ``mlp_only_layers`` and in layers ``l`` with ``(l + 1) % decoder_sparse_step != 0``; Qwen3-MoE q/k norm
    per head, Qwen2-MoE a gated shared expert of ``shared_expert_intermediate_size``; OLMoE Mixtral's experts
    with ``norm_topk_prob`` and RMSNorm over the whole q and k projections (OLMo 2's); Granite-MoE (with
    Granite's multipliers) the top-k logits then softmax over them, SiLU experts of ``intermediate_size``;
    GPT-OSS top-k of the logits then softmax, router and expert biases, the clamped SwiGLU, sinks."""
    experts_key = "num_local_experts" if d.get("num_local_experts") is not None else "num_experts"
    n = d["num_hidden_layers"]
    fields = dict(num_experts=_positive_int(d, experts_key, d.get(experts_key)),
                  num_experts_per_tok=_positive_int(d, "num_experts_per_tok", d.get("num_experts_per_tok")),
                  moe_intermediate_size=d["intermediate_size"])
    if fields["num_experts_per_tok"] > fields["num_experts"]:
        raise ValueError(f"config.json: num_experts_per_tok={fields['num_experts_per_tok']} is more than "
                         f"{experts_key}={fields['num_experts']}")
    if kind in ("qwen2_moe", "qwen3_moe"):
        fields.update(moe_renormalize=bool(d["norm_topk_prob"]),
                      moe_intermediate_size=_positive_int(d, "moe_intermediate_size", d["moe_intermediate_size"]))
        if kind == "qwen3_moe":
            fields["qk_norm"] = "head"
        else:  # a size of 0 (transformers would build an empty one and its gate) is refused
            fields["shared_expert_intermediate_size"] = _positive_int(
                d, "shared_expert_intermediate_size", d["shared_expert_intermediate_size"])
        step = _positive_int(d, "decoder_sparse_step", d["decoder_sparse_step"])
        only = d.get("mlp_only_layers") or []
        if not isinstance(only, (list, tuple)) or any(not isinstance(i, int) or not 0 <= i < n for i in only):
            raise ValueError(f"config.json: mlp_only_layers must list layer indices in [0, {n}), got {only!r}")
        fields["dense_layers"] = tuple(i for i in range(n) if i in only or (i + 1) % step)
    elif kind == "olmoe":
        fields.update(qk_norm="projection", moe_renormalize=bool(d["norm_topk_prob"]))
    elif kind == "granitemoe":
        fields.update(moe_scoring="topk_softmax", moe_renormalize=False)
    elif kind == "gpt_oss":
        quant = d.get("quantization_config")
        if quant is not None:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            if method != "mxfp4":
                raise ValueError(f"config.json: quantization_config with quant_method={method!r} is not loaded "
                                 "for GptOssForCausalLM (implemented: 'mxfp4' experts, dequantized at load)")
            for key in ("hidden_size", "intermediate_size"):
                if d[key] % 32:
                    raise ValueError(f"config.json: {key}={d[key]} is not a multiple of 32, the MXFP4 block")
            fields["moe_quant"] = "mxfp4"
        fields.update(attention_sinks=True, moe_scoring="topk_softmax", moe_renormalize=False,
                      moe_activation="swigluoai", moe_bias=True,
                      swiglu_alpha=float(d["swiglu_alpha"]), swiglu_limit=float(d["swiglu_limit"]))
    return fields


def _layer_types(d: dict, kind: str) -> tuple[str, ...]:
    """Which layers slide, as transformers decides: ``layer_types`` when given to a family whose
    transformers model reads it (:data:`READS_LAYER_TYPES`; elsewhere it is checked, then ignored as
    transformers ignores it); else for Qwen2/3 the layers from ``max_window_layers`` on, for Qwen2-MoE
    every other layer (the first slides) below ``max_window_layers``, for Gemma 2
    and GPT-OSS every other layer (the first slides), for Gemma 3 all but every
    ``sliding_window_pattern``-th; otherwise every layer (returned as ``()``)."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    kinds = ("full_attention", "sliding_attention")
    if types is not None and (len(types) != n or any(t not in kinds for t in types)):
        raise ValueError(f"config.json: layer_types must name one of {kinds} for each of the {n} layers, "
                         f"got {types!r}")
    if types is not None and kind in READS_LAYER_TYPES:
        return tuple(types)
    if kind in ("qwen2", "qwen3"):
        first = d["max_window_layers"]
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    if kind == "qwen2_moe":
        first = d["max_window_layers"]
        return tuple("sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(n))
    if kind in ("gemma2", "gemma3", "gpt_oss"):
        every = _positive_int(d, "sliding_window_pattern", d["sliding_window_pattern"]) if kind == "gemma3" else 2
        return tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(n))
    return ()


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)



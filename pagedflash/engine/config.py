"""ModelConfig: the few numbers a Llama-architecture decoder needs, read from a Hugging Face config.

Accepted sources: a local model directory (its ``config.json``), a ``transformers`` config object, or
a plain dict with HF keys. Both RoPE spellings are read: the older ``rope_theta`` + ``rope_scaling``
and the newer ``rope_parameters``. Supported RoPE types: ``default``, ``linear``, ``llama3``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

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
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" or "sliding_attention"; () = all alike
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

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
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = MODEL_TYPE_TO_ARCH.get(d.get("model_type", ""))
        if arch is None:
            name = ", ".join(archs) if archs else f"model_type={d.get('model_type')!r}"
            raise ValueError(
                f"unsupported architecture {name}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        kind = SUPPORTED_ARCHITECTURES[arch]
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(d.get(key), int) or d[key] < 1:
                raise ValueError(f"config.json: {key} must be a positive int, got {d.get(key)!r}")
        num_heads = d["num_attention_heads"]
        num_kv_heads = d.get("num_key_value_heads") or num_heads
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        if not 16 <= head_dim <= 256:
            raise ValueError(f"head_dim={head_dim} is outside the attention kernels' range [16, 256]")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (SwiGLU with silu only)")
        theta, scaling = _rope_from_dict(d)
        attn_bias = bool(d.get("attention_bias", False))
        sliding = d.get("sliding_window")
        if kind == "llama" or (kind == "qwen2" and not d.get("use_sliding_window", False)):
            sliding = None  # transformers' Llama ignores the key; Qwen2 slides only when told to
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=True if kind == "qwen2" else attn_bias,
            o_bias=False if kind == "qwen2" else attn_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=int(sliding) if sliding else None,
            layer_types=_layer_types(d, kind) if sliding else (),
            initializer_range=float(d.get("initializer_range", 0.02)),
            eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )

    # ------------------------------------------------------------------ derived
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends within ``sliding_window`` (every layer, unless ``layer_types`` says)."""
        if not self.sliding_window:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + h

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies ``[D/2]`` fp32 on the CPU, with the configured scaling (as transformers
        computes them)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
        kind = self.rope_scaling.get("rope_type", "default")
        if kind == "linear":
            inv = inv / self.rope_scaling["factor"]
        elif kind == "llama3":
            s = self.rope_scaling
            factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
            old_len = s["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            inv = torch.where(is_medium, smoothed, scaled)
        return inv


def _layer_types(d: dict, kind: str) -> tuple[str, ...]:
    """Which layers slide, as transformers decides: ``layer_types`` when given; for Qwen2 the layers
    from ``max_window_layers`` on; otherwise every layer (returned as ``()``)."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        if kind != "qwen2":
            return ()
        first = d.get("max_window_layers", 28)  # transformers' Qwen2Config default
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    kinds = ("full_attention", "sliding_attention")
    if len(types) != n or any(t not in kinds for t in types):
        raise ValueError(f"config.json: layer_types must name one of {kinds} for each of the {n} layers, "
                         f"got {types!r}")
    return tuple(types)


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_dict(d: dict) -> tuple[float, dict]:
    """(theta, scaling dict) from either ``rope_parameters`` or ``rope_theta``/``rope_scaling``."""
    params = d.get("rope_parameters") or {}
    if params and not isinstance(params.get("rope_theta", 0.0), (int, float)):
        raise ValueError("per-layer rope_parameters are not supported")
    scaling = dict(d.get("rope_scaling") or {})
    scaling.update({k: v for k, v in params.items() if k != "rope_theta"})
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE scaling {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind == "default":
        return theta, {}
    scaling["rope_type"] = kind
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings"))
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if scaling.get(key) is None:
                raise ValueError(f"llama3 RoPE scaling needs {key!r}")
    elif "factor" not in scaling:
        raise ValueError(f"{kind} RoPE scaling needs 'factor'")
    return theta, scaling

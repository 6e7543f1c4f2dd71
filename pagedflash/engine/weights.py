"""Build the model and fill it: from a local Hugging Face directory (``*.safetensors``, sharded through
``model.safetensors.index.json`` or not, HF tensor names) or with seeded random weights.

Strict: every HF tensor is shape-checked against the slot it fills, and a missing or mis-shaped
tensor raises a ``ValueError`` naming it; so does a tensor the model does not use (a q/k norm of a
relabelled checkpoint, say), except the few that carry nothing the model lacks: ``rotary_emb.inv_freq``
(recomputed from the config), K/V cache scales (:func:`read_kv_scales` reads them), and
``lm_head.weight`` of a model with tied embeddings.

Gemma's norms scale by ``1 + w``: the loader stores ``w + ModelConfig.norm_offset`` (see
:mod:`pagedflash.engine.models.common`). Phi-3's checkpoints hold ``qkv_proj`` and ``gate_up_proj``
already fused; each rank reads its rows of each part.

Mixture-of-experts checkpoints (:mod:`pagedflash.engine.models.moe` holds ``experts.w13 [E, 2 I, H]``,
``experts.w2 [E, H, I]`` and GPT-OSS's biases): Mixtral's per-expert ``experts.{e}.w1/w3/w2.weight``
and Qwen2/3-MoE's and OLMoE's ``experts.{e}.gate_proj/up_proj/down_proj.weight`` fill expert ``e``'s rows
(Qwen2-MoE's ``shared_expert`` is an MLP as a dense layer's, its ``shared_expert_gate`` a last row of
the router's ``gate``); Granite-MoE's ``input_linear [E, 2 I, H]`` and ``output_linear [E, H, I]``
are the layout itself (its router under ``router.layer``); GPT-OSS's ``experts.gate_up_proj [E, H,
2 I]`` (gate and up interleaved on the last dim, as its ``gate_up_proj_bias [E, 2 I]``),
``down_proj [E, I, H]`` and ``down_proj_bias [E, H]`` are sliced, de-interleaved and transposed. A rank reads its rows of each expert. GPT-OSS's MXFP4 experts
(``quantization_config.quant_method == "mxfp4"``: ``gate_up_proj_blocks/_scales`` and
``down_proj_blocks/_scales``, 32 4-bit values and one power-of-two exponent per block, out-major)
are dequantized at load, as transformers' ``convert_moe_packed_tensors`` does.

A tensor-parallel rank fills only its shard (:mod:`pagedflash.engine.parallel` says which rows and
columns): from a checkpoint it reads just those slices (safetensors ``get_slice``), never a whole
tensor; with random weights it draws each tensor as one GPU would (so the model is the same for
every ``tensor_parallel_size``), one tensor at a time, and keeps its slice.
"""

from __future__ import annotations

import glob
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pagedflash.engine.config import ModelConfig
from pagedflash.engine.models import CausalLM, model_class
from pagedflash.engine.parallel import Collectives, ShardSizes

# fused parameter -> the HF projections stacked (in this order) on its output dim
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_ROW_PARALLEL = ("o_proj", "down_proj")  # split on the input dim; the all-reduce sums their outputs
_VOCAB = ("embed_tokens", "lm_head")
_FUSED_IN_CHECKPOINT = ("Phi3ForCausalLM",)  # architectures whose checkpoints hold qkv_proj/gate_up_proj
# per-expert checkpoint tensors of (gate, up, down), by architecture
_EXPERT_NAMES = {"MixtralForCausalLM": ("w1", "w3", "w2"),
                 "Qwen2MoeForCausalLM": ("gate_proj", "up_proj", "down_proj"),
                 "Qwen3MoeForCausalLM": ("gate_proj", "up_proj", "down_proj"),
                 "OlmoeForCausalLM": ("gate_proj", "up_proj", "down_proj")}


def _ignored(name: str, config: ModelConfig) -> bool:
    """Whether the checkpoint tensor ``name`` may go unused (see the module docstring)."""
    return (name.endswith("rotary_emb.inv_freq") or _KV_SCALE.search(name) is not None
            or (name == "lm_head.weight" and config.tie_word_embeddings))


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


@dataclass(frozen=True)
class Piece:
    """Part of a parameter taken from one HF tensor: ``length`` rows (``dim`` 0) or columns (``dim``
    1) from ``start`` of the HF tensor, written from ``offset`` of the parameter. ``full``: the HF
    tensor's size along ``dim``; ``fused_offset``: where the HF tensor starts in the one-rank fused
    parameter (q, k, v stacked)."""

    hf_name: str
    dim: int
    start: int
    length: int
    offset: int
    full: int
    fused_offset: int = 0
    index: int | None = None  # the piece fills ``param[index]`` (an expert) instead of ``param``
    convert: object = None  # the read slice -> the whole (indexed) parameter; None: copied as is
    hf_shape: tuple[int, ...] | None = None  # the HF tensor's shape when not the parameter's
    scales: str | None = None  # MXFP4: the scales tensor of these blocks (the same slice is read of it)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(config: ModelConfig, *, max_len: int, dtype: torch.dtype, device: torch.device,
                shard: ShardSizes | None = None, comm: Collectives | None = None) -> CausalLM:
    """An uninitialized model (or this rank's shard of it, with its group ``comm``) with parameters
    in ``dtype`` on ``device`` (RoPE tables stay fp32)."""
    with _default_dtype(dtype), torch.device(device):
        model = model_class(config)(config, max_len, shard, comm)
    for rope in (model.rotary_emb, model.rotary_emb_local):
        if rope is not None:
            rope.to(device)  # fp32 tables built on the CPU
    return model.eval().requires_grad_(False)


def pieces(name: str, param: torch.Tensor, config: ModelConfig, shard: ShardSizes) -> list[Piece]:
    """Where the parameter ``name`` of ``shard``'s model comes from, HF tensor by HF tensor. A
    parameter whose pieces do not cover it is zero elsewhere (vocabulary padding; a row-parallel bias
    off rank 0)."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    prefix = ".".join(parts[:-2])
    d = config.head_dim
    if module == "experts":
        return _expert_pieces(prefix, kind, param, config, shard)
    if module == "router" and config.architecture == "GraniteMoeForCausalLM":  # the checkpoint's router.layer
        return [Piece(f"{prefix}.router.layer.{kind}", 0, 0, param.shape[0], 0, param.shape[0])]
    if module == "gate" and kind == "weight" and config.shared_expert_intermediate_size:
        e = config.num_experts  # the router's rows, then the shared expert's gate (models.moe.SparseMoE)
        return [Piece(name, 0, 0, e, 0, e), Piece(f"{prefix}.shared_expert_gate.weight", 0, 0, 1, e, 1, e)]
    if kind == "sinks":  # one per query head: this rank's heads
        return [Piece(name, 0, shard.rank * shard.num_heads, shard.num_heads, 0, config.num_heads)]
    if module in ("q_norm", "k_norm") and config.qk_norm == "projection":  # this rank's heads of it
        if module == "q_norm":
            return [Piece(name, 0, shard.rank * shard.num_heads * d, shard.num_heads * d, 0, config.q_size)]
        return [Piece(name, 0, shard.kv_head_start * d, shard.num_kv_heads * d, 0, config.kv_size)]
    if module in _FUSED:
        if module == "qkv_proj":
            q, kv = shard.num_heads * d, shard.num_kv_heads * d
            spans = [(shard.rank * q, q, config.q_size), (shard.kv_head_start * d, kv, config.kv_size),
                     (shard.kv_head_start * d, kv, config.kv_size)]
        else:
            i, full = _mlp_rows(prefix, config, shard)
            spans = [(shard.rank * i, i, full)] * 2
        out, offset, fused = [], 0, 0
        for hf, (start, length, full) in zip(_FUSED[module], spans):
            out.append(Piece(f"{prefix}.{hf}.{kind}", 0, start, length, offset, full, fused))
            offset, fused = offset + length, fused + full
        if config.architecture in _FUSED_IN_CHECKPOINT:  # the same rows, read from the one fused tensor
            return [Piece(name, 0, p.fused_offset + p.start, p.length, p.offset, fused) for p in out]
        return out
    if module in _ROW_PARALLEL and kind == "weight":
        local = param.shape[1]
        full = config.q_size if module == "o_proj" else _mlp_rows(prefix, config, shard)[1]
        return [Piece(name, 1, shard.rank * local, local, 0, full)]
    if module in _ROW_PARALLEL and shard.rank > 0:
        return []  # the bias: added once, by rank 0
    if module in _VOCAB:
        return [Piece(name, 0, shard.vocab_start, shard.vocab_rows, 0, config.vocab_size)]
    return [Piece(name, 0, 0, param.shape[0], 0, param.shape[0])]


def _mlp_rows(prefix: str, config: ModelConfig, shard: ShardSizes) -> tuple[int, int]:
    """``(this rank's, the model's)`` intermediate rows of the MLP at ``prefix`` (a layer's, or
    Qwen2-MoE's shared expert)."""
    if prefix.endswith(".shared_expert"):
        return shard.shared_expert_intermediate_size, config.shared_expert_intermediate_size
    return shard.intermediate_size, config.intermediate_size


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's interleaved gate/up ``[..., 2 n]`` (gate at even positions) -> gate then up."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _gate_up_rows(x: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's ``gate_up_proj`` slice ``[E, H, 2 n]`` (interleaved) -> ``w13 [E, 2 n, H]``."""
    return _deinterleave(x).transpose(1, 2)


def _down_rows(x: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's ``down_proj`` slice ``[E, n, H]`` -> ``w2 [E, H, n]``."""
    return x.transpose(1, 2)


def _expert_pieces(prefix: str, kind: str, param: torch.Tensor, config: ModelConfig, shard: ShardSizes):
    """Where the expert parameter ``{prefix}.experts.{kind}`` comes from (see the module docstring)."""
    e, h, full = config.num_experts, config.hidden_size, config.moe_intermediate_size
    i = shard.moe_intermediate_size
    start = shard.rank * i
    base = f"{prefix}.experts"
    names = _EXPERT_NAMES.get(config.architecture)
    if config.architecture == "GraniteMoeForCausalLM":  # input_linear [E, 2 I, H] (gate, up), output_linear [E, H, I]
        if kind == "w13":
            hf = f"{prefix}.input_linear.weight"
            return [Piece(hf, 1, start, i, 0, 2 * full), Piece(hf, 1, full + start, i, i, 2 * full)]
        if kind == "w2":
            return [Piece(f"{prefix}.output_linear.weight", 2, start, i, 0, full)]
        raise ValueError(f"{config.architecture} has no expert parameter {kind!r}")
    if names is not None:
        gate, up, down = names
        if kind == "w13":
            return [Piece(f"{base}.{x}.{hf}.weight", 0, start, i, offset, full, index=x)
                    for x in range(e) for hf, offset in ((gate, 0), (up, i))]
        if kind == "w2":
            return [Piece(f"{base}.{x}.{down}.weight", 1, start, i, 0, full, index=x) for x in range(e)]
        raise ValueError(f"{config.architecture} has no expert parameter {kind!r}")
    # GPT-OSS: one tensor per kind, gate and up interleaved
    if config.moe_quant == "mxfp4" and kind in ("w13", "w2"):
        return [_mxfp4_piece(base, kind, config, shard)]
    if kind == "w13":
        return [Piece(f"{base}.gate_up_proj", 2, 2 * start, 2 * i, 0, 2 * full, convert=_gate_up_rows,
                      hf_shape=(e, h, 2 * full))]
    if kind == "w13_bias":
        return [Piece(f"{base}.gate_up_proj_bias", 1, 2 * start, 2 * i, 0, 2 * full, convert=_deinterleave,
                      hf_shape=(e, 2 * full))]
    if kind == "w2":
        return [Piece(f"{base}.down_proj", 1, start, i, 0, full, convert=_down_rows, hf_shape=(e, full, h))]
    # w2_bias: added once, by rank 0; other ranks read none of it (a piece of length 0, zero)
    return [Piece(f"{base}.down_proj_bias", 0, 0, e if shard.rank == 0 else 0, 0, e, hf_shape=(e, h))]


MXFP4_BLOCK = 32  # values per MXFP4 block (16 bytes of two 4-bit values) and per exponent
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks`` uint8 ``[..., G, 16]`` (low nibble first) and ``scales`` uint8 ``[..., G]``
    (exponent + 127) -> fp32 ``[..., 32 G]``: ``value * 2 ** (scale - 127)``."""
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    out = torch.stack([lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]], dim=-1).flatten(-2)
    out = torch.ldexp(out, (scales.to(torch.int32) - 127)[..., None])
    return out.flatten(-2)


def _mxfp4_piece(base: str, kind: str, config: ModelConfig, shard: ShardSizes) -> Piece:
    """GPT-OSS's MXFP4 experts, out-major: ``gate_up_proj_blocks [E, 2 I, H / 32, 16]`` (gate and up
    rows interleaved; this rank's rows, de-interleaved) and ``down_proj_blocks [E, H, I / 32, 16]``
    (the blocks holding this rank's columns, narrowed to them once dequantized)."""
    e, h, full, i = config.num_experts, config.hidden_size, config.moe_intermediate_size, shard.moe_intermediate_size
    start = shard.rank * i
    if kind == "w13":
        return Piece(f"{base}.gate_up_proj_blocks", 1, 2 * start, 2 * i, 0, 2 * full,
                     convert=lambda x: _deinterleave(x.transpose(1, 2)).transpose(1, 2),
                     hf_shape=(e, 2 * full, h // MXFP4_BLOCK, 16), scales=f"{base}.gate_up_proj_scales")
    first, last = start // MXFP4_BLOCK, -(-(start + i) // MXFP4_BLOCK)
    skip = start - first * MXFP4_BLOCK
    return Piece(f"{base}.down_proj_blocks", 2, first, last - first, 0, full // MXFP4_BLOCK,
                 convert=lambda x: x.narrow(2, skip, i), hf_shape=(e, h, full // MXFP4_BLOCK, 16),
                 scales=f"{base}.down_proj_scales")


def _covers(param: torch.Tensor, parts: list[Piece]) -> bool:
    """Whether ``parts`` (all along one dim, of the parameter or of each of its entries) fill the
    whole parameter."""
    if not parts:
        return False
    first = parts[0]
    if first.convert is not None:
        return True
    if first.index is None:
        return sum(p.length for p in parts) == param.shape[first.dim]
    return sum(p.length for p in parts) == param.shape[0] * param.shape[first.dim + 1]


def _hf_shape(param: torch.Tensor, piece: Piece) -> tuple[int, ...]:
    shape = list(param.shape)
    shape[piece.dim] = piece.full
    return tuple(shape)


def _one_rank_shape(param: torch.Tensor, parts: list[Piece]) -> tuple[int, ...]:
    """The parameter's shape in the one-rank model (fused projections whole)."""
    shape = list(param.shape)
    shape[parts[0].dim] = parts[-1].fused_offset + parts[-1].full
    return tuple(shape)


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({os.path.join(path, v) for v in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{path}: shard {os.path.basename(missing[0])} listed in the index is missing")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path!r} has no *.safetensors weights")
    return files


@torch.no_grad()
def load_weights(model: CausalLM, path: str) -> None:
    """Copy a local HF checkpoint into ``model`` (fused projections assembled from their shards; a
    tensor-parallel rank reads only its slices)."""
    from safetensors import safe_open

    wanted: dict[str, list[tuple[torch.Tensor, Piece]]] = {}
    other_ranks: set[str] = set()  # tensors of the model that this rank does not read (row-parallel biases)
    for name, param in model.named_parameters():  # a tied lm_head appears once, as embed_tokens
        parts = pieces(name, param, model.config, model.shard)
        if not _covers(param, parts):
            param.zero_()
        if not parts:
            other_ranks.add(name)
        for piece in parts:
            wanted.setdefault(piece.hf_name, []).append((param, piece))
    loaded: set[str] = set()
    unused: list[str] = []
    files = _safetensors_files(path)
    companions = {piece.scales for targets in wanted.values() for _, piece in targets if piece.scales}
    where: dict[str, str] = {}  # a companion tensor -> its file
    if companions:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                where.update((name, file) for name in f.keys() if name in companions)
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                targets = wanted.get(hf_name)
                if not targets:
                    if hf_name not in other_ranks and hf_name not in companions and not _ignored(hf_name, model.config):
                        unused.append(hf_name)
                    continue
                tensor = f.get_slice(hf_name)
                shape = tuple(tensor.get_shape())
                for param, piece in targets:
                    target = param if piece.index is None else param[piece.index]
                    want = piece.hf_shape or _hf_shape(target, piece)
                    if shape != want:
                        raise ValueError(f"weight {hf_name!r} in {os.path.basename(file)} has shape {shape}, "
                                         f"expected {want}")
                    if piece.length == 0:
                        continue
                    span = (slice(None),) * piece.dim + (slice(piece.start, piece.start + piece.length),)
                    part = tensor[span]
                    if piece.scales is not None:  # one expert at a time: a transient fp32 copy of one
                        scales = _read_companion(piece.scales, where, want[:-1], span, path)
                        for x in range(part.shape[0]):
                            one = dequantize_mxfp4(part[x : x + 1], scales[x : x + 1])
                            target[x : x + 1].copy_(piece.convert(one))
                        loaded.add(piece.scales)
                    elif piece.convert is not None:
                        target.copy_(piece.convert(part))
                    else:
                        target.narrow(piece.dim, piece.offset, piece.length).copy_(part)
                loaded.add(hf_name)
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise ValueError(f"{path!r}: checkpoint tensors that {model.config.architecture} does not use: "
                         f"{', '.join(map(repr, unused[:3]))}{more} (a checkpoint of another architecture, "
                         "or math this engine does not implement)")
    missing = [n for n in wanted if n not in loaded]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"weights missing from {path!r}: {missing[0]!r}{more}")
    if model.config.norm_offset:
        for name, param in model.named_parameters():
            if _is_norm(name):
                param.add_(model.config.norm_offset)


def _read_companion(name: str, where: dict[str, str], shape: tuple[int, ...], span: tuple, path: str):
    """The ``span`` of tensor ``name`` (MXFP4 scales), checked to have ``shape``."""
    from safetensors import safe_open

    if name not in where:
        raise ValueError(f"weights missing from {path!r}: {name!r}")
    with safe_open(where[name], framework="pt", device="cpu") as f:
        tensor = f.get_slice(name)
        if tuple(tensor.get_shape()) != shape:
            raise ValueError(f"weight {name!r} in {os.path.basename(where[name])} has shape "
                             f"{tuple(tensor.get_shape())}, expected {shape}")
        return tensor[span]


@torch.no_grad()
def init_random_weights(model: CausalLM, seed: int = 0) -> None:
    """Seeded random weights like HF's init: normal(0, initializer_range) matrices, zero biases, unit norms.

    Drawn on the model's device with a generator seeded by ``seed`` (same seed, same device kind:
    same weights). A tensor-parallel rank draws every matrix whole, in the one-rank model's order, and
    keeps its slice: the same weights as one device, one transient full matrix at a time.
    """
    std = model.config.initializer_range
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if _is_norm(name):
            param.fill_(1.0)
        elif name.endswith("bias"):  # experts' w13_bias / w2_bias too
            param.zero_()
        elif model.comm.size == 1:
            param.copy_(torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32) * std)
        elif name.endswith(("experts.w13", "experts.w2")):
            param.copy_(_expert_shard(name, gen, model.config, model.shard, device) * std)
        else:
            parts = pieces(name, param, model.config, model.shard)
            full = torch.randn(_one_rank_shape(param, parts), generator=gen, device=device, dtype=torch.float32)
            param.zero_()
            for p in parts:
                src = full.narrow(p.dim, p.fused_offset + p.start, p.length)
                param.narrow(p.dim, p.offset, p.length).copy_(src * std)


def _expert_shard(name: str, gen: torch.Generator, config: ModelConfig, shard: ShardSizes, device) -> torch.Tensor:
    """This rank's part of the one-rank model's expert parameter ``name`` (``w13`` or ``w2``), drawn whole."""
    e, h, full, i = config.num_experts, config.hidden_size, config.moe_intermediate_size, shard.moe_intermediate_size
    start = shard.rank * i
    if name.endswith("w13"):
        whole = torch.randn((e, 2 * full, h), generator=gen, device=device, dtype=torch.float32)
        return torch.cat([whole[:, start : start + i], whole[:, full + start : full + start + i]], dim=1)
    whole = torch.randn((e, h, full), generator=gen, device=device, dtype=torch.float32)
    return whole[:, :, start : start + i]


# K/V cache scales of fp8-calibrated checkpoints, under the names vLLM reads: compressed-tensors'
# ``...self_attn.k_scale``, ModelOpt's ``...self_attn.k_proj.k_scale`` / ``v_proj.v_scale``, vLLM's own
# ``...self_attn.attn.k_scale``, and the older single ``...kv_scale`` (one value for keys and values)
_KV_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(?:attn|k_proj|v_proj)\.)?(k_scale|v_scale|kv_scale)$")


def read_kv_scales(path: str, num_layers: int, num_kv_heads: int) -> tuple[list | None, list | None]:
    """Per-layer fp8 K/V cache scales from a local checkpoint: ``(k_scales, v_scales)``, each a list of
    ``num_layers`` entries (``stored = k / scale``), a float per tensor or a list of ``num_kv_heads``
    floats per KV head, or None where the checkpoint has none. A checkpoint with scales for some
    layers and not others raises."""
    from safetensors import safe_open

    found: dict[str, dict[int, float | list[float]]] = {"k_scale": {}, "v_scale": {}, "kv_scale": {}}
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                m = _KV_SCALE.search(name)
                if m is None:
                    continue
                raw = f.get_tensor(name)
                t = raw.float().reshape(-1)
                if t.numel() not in (1, num_kv_heads):
                    raise ValueError(f"{name!r} in {os.path.basename(file)}: expected one scale per tensor or "
                                     f"{num_kv_heads} (per KV head), got shape {tuple(raw.shape)}")
                found[m.group(2)][int(m.group(1))] = float(t) if t.numel() == 1 else t.tolist()
    for layer, value in found["kv_scale"].items():  # the old format: one value for both
        found["k_scale"].setdefault(layer, value)
        found["v_scale"].setdefault(layer, value)
    out = []
    for kind in ("k_scale", "v_scale"):
        layers = found[kind]
        if layers and sorted(layers) != list(range(num_layers)):
            missing = sorted(set(range(num_layers)) - set(layers))
            raise ValueError(f"{path}: {kind} given for some layers but not for layers {missing[:8]}")
        out.append([layers[i] for i in range(num_layers)] if layers else None)
    return out[0], out[1]

"""Build the model and fill it: from a local Hugging Face directory (``*.safetensors``, sharded through
``model.safetensors.index.json`` or not, HF tensor names) or with seeded random weights.

Every HF tensor is shape-checked against the slot it fills; a missing or mis-shaped tensor raises a
``ValueError`` naming it. Tensors the model does not use (``rotary_emb.inv_freq``, ...) are ignored.
"""

from __future__ import annotations

import glob
import json
import os
from contextlib import contextmanager

import torch

from pagedflash.engine.config import ModelConfig
from pagedflash.engine.model import CausalLM

# HF projection name -> (fused parameter, index of its shard along the output dim)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(config: ModelConfig, *, max_len: int, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """An uninitialized model with parameters in ``dtype`` on ``device`` (RoPE tables stay fp32)."""
    with _default_dtype(dtype), torch.device(device):
        model = CausalLM(config, max_len)
    model.rotary_emb.to(device)  # fp32 tables built on the CPU
    return model.eval().requires_grad_(False)


def _shard_sizes(config: ModelConfig, fused: str) -> list[int]:
    if fused == "qkv_proj":
        return [config.q_size, config.kv_size, config.kv_size]
    return [config.intermediate_size, config.intermediate_size]


def _expected_hf_names(model: CausalLM) -> list[str]:
    """Every HF tensor name the model needs (a tied lm_head is not one: it is embed_tokens)."""
    names = []
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in ("qkv_proj", "gate_up_proj"):
            hf = [k for k, (f, _) in _FUSED.items() if f == parts[-2]]
            names += [".".join(parts[:-2] + [h, parts[-1]]) for h in hf]
        else:
            names.append(name)
    return names


def _target(params: dict, config: ModelConfig, hf_name: str):
    """(parameter, row offset, rows) that the HF tensor fills, or None if the model does not use it."""
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, idx = _FUSED[parts[-2]]
        pname = ".".join(parts[:-2] + [fused, parts[-1]])
        sizes = _shard_sizes(config, fused)
    else:
        pname, idx, sizes = hf_name, 0, None
    param = params.get(pname)
    if param is None:
        return None
    if sizes is None:
        return param, 0, param.shape[0]
    return param, sum(sizes[:idx]), sizes[idx]


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
    """Copy a local HF checkpoint into ``model`` (fused projections assembled from their shards)."""
    from safetensors import safe_open

    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    loaded: set[str] = set()
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                target = _target(params, model.config, hf_name)
                if target is None:
                    continue
                param, offset, rows = target
                tensor = f.get_tensor(hf_name)
                want = (rows, *param.shape[1:])
                if tuple(tensor.shape) != tuple(want):
                    raise ValueError(
                        f"weight {hf_name!r} in {os.path.basename(file)} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(want)}"
                    )
                param.narrow(0, offset, rows).copy_(tensor)
                loaded.add(hf_name)
    missing = [n for n in _expected_hf_names(model) if n not in loaded]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"weights missing from {path!r}: {missing[0]!r}{more}")


@torch.no_grad()
def init_random_weights(model: CausalLM, seed: int = 0) -> None:
    """Seeded random weights like HF's init: normal(0, initializer_range) matrices, zero biases, unit norms.

    Drawn on the model's device with a generator seeded by ``seed`` (same seed, same device kind:
    same weights).
    """
    std = model.config.initializer_range
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.copy_(torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32) * std)

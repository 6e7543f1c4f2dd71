"""The HBM bandwidth the benches' bandwidth bounds and "of peak" figures divide by: the datasheet
figure of the GPU the bench runs on, by CUDA device name (``PAGEDFLASH_HBM_TBPS`` overrides it);
every note that uses it names the figure and where it came from, and the result files record it."""

from __future__ import annotations

import functools
import math
import os
import re
import warnings
from dataclasses import dataclass

import torch

from pagedflash.bench.common import has_gpu

H200_TBPS = 4.8  # the H200's HBM3e datasheet bandwidth, TB/s: the GPU the published figures were taken on
HBM_TBPS_ENV = "PAGEDFLASH_HBM_TBPS"

# Datasheet HBM bandwidth by CUDA device name: (pattern searched in the upper-cased
# torch.cuda.get_device_name, TB/s, the part). The first match wins: a variant precedes its family.
_DATASHEET_TBPS = (
    (r"\bGH200\b.*(HBM3E|\b144G)", 4.9, "GH200 144 GB HBM3e"),
    (r"\bGH200\b", 4.0, "GH200 96 GB HBM3"),  # "NVIDIA GH200 480GB": 96 GB HBM3 + 480 GB LPDDR5X
    (r"\bH200\b", H200_TBPS, "H200 141 GB HBM3e, SXM or NVL"),
    (r"\bH100\b.*\bNVL\b", 3.9, "H100 NVL 94 GB HBM3"),
    (r"\bH100\b.*\bPCIE\b", 2.0, "H100 PCIe 80 GB HBM2e"),
    (r"\bH100\b.*(\bHBM3\b|\bSXM)", 3.35, "H100 SXM 80 GB HBM3"),
    (r"\bH20\b", 4.0, "H20 96 GB HBM3"),
    (r"\bA100\b.*(\b80GB\b.*\bPCIE\b|\bPCIE\b.*\b80GB\b)", 1.935, "A100 80 GB PCIe"),
    (r"\bA100\b.*\b80GB\b", 2.039, "A100 80 GB SXM"),
    (r"\bA100\b.*\b40GB\b", 1.555, "A100 40 GB"),
    (r"\bL40S\b", 0.864, "L40S"),
    (r"\bB200\b", 8.0, "B200"),
    (r"\bMI300X\b", 5.3, "MI300X"),
)


@dataclass(frozen=True)
class HBMBandwidth:
    """The HBM bandwidth the bandwidth bounds divide by: ``tbps`` TB/s per GPU, for ``device`` (the
    CUDA device name, or ``"cpu"``), taken from ``source``; ``known`` is False where no figure
    for this device was found and the H200's stands in."""

    tbps: float
    device: str
    source: str
    known: bool = True

    def __str__(self) -> str:
        return f"{self.tbps:g} TB/s ({self.source})"


def gpu_name() -> str | None:
    """The current CUDA device's name (``torch.cuda.get_device_name``), None without a GPU."""
    return _device_name(torch.cuda.current_device()) if has_gpu() else None


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def datasheet_tbps(name: str) -> tuple[float, str] | None:
    """``(TB/s, part)`` of the GPU a CUDA device name denotes, from the datasheet table; None when
    the name is not in it."""
    upper = name.upper()
    return next(((tbps, part) for pattern, tbps, part in _DATASHEET_TBPS if re.search(pattern, upper)), None)


def hbm_bandwidth() -> HBMBandwidth:
    """The HBM bandwidth of the GPU the bench runs on (the current CUDA device).

    ``PAGEDFLASH_HBM_TBPS`` (TB/s, a positive number; empty counts as unset) overrides everything;
    several GPUs count as copies of the current one. Otherwise: a GPU in the
    datasheet table gets its figure; a GPU not in it gets the H200's 4.8 TB/s with a warning, and
    the figure says so wherever it is printed (``known=False``), because the timings stay valid and
    only the bound columns depend on it; no GPU (the CPU interpreter's smoke runs) gets the H200's,
    the GPU the published figures were taken on."""
    name = gpu_name()
    override = os.environ.get(HBM_TBPS_ENV, "").strip()
    if override:
        return HBMBandwidth(_positive_tbps(override), name or "cpu", f"{HBM_TBPS_ENV} on {name or 'the CPU'}")
    if name is None:
        return HBMBandwidth(H200_TBPS, "cpu", "no GPU: the H200 datasheet figure the published results use")
    return _from_datasheet(name)


def _positive_tbps(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{HBM_TBPS_ENV} must be a positive number of TB/s (e.g. 3.35), got {raw!r}")
    return value


@functools.cache
def _from_datasheet(name: str) -> HBMBandwidth:
    found = datasheet_tbps(name)
    if found is not None:
        return HBMBandwidth(found[0], name, f"{name}: {found[1]} datasheet")
    warnings.warn(f"GPU {name!r} is not in pagedflash's HBM bandwidth table: the bandwidth bounds use the H200's "
                  f"{H200_TBPS} TB/s; set {HBM_TBPS_ENV} to this GPU's TB/s", RuntimeWarning, stacklevel=2)
    return HBMBandwidth(H200_TBPS, name, f"the H200's figure, NOT this GPU's: {name!r} is not in pagedflash's "
                        f"table, set {HBM_TBPS_ENV}", known=False)

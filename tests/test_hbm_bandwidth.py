"""The HBM bandwidth the benches' bounds divide by (:func:`pagedflash.bench.hbm.hbm_bandwidth`):
the datasheet figure by CUDA device name, ``PAGEDFLASH_HBM_TBPS`` overriding it (checked), the H200's
figure named as such on the CPU and, with a warning, for a GPU not in the table; the decode-step and
MoE bounds, the notes and the result files use it."""

import json
import math

import pytest
import torch

from pagedflash.bench import common, decode, hbm, moe, report
from pagedflash.bench.decode_bound import bound_seconds

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(hbm.HBM_TBPS_ENV, raising=False)
    hbm._from_datasheet.cache_clear()  # the unknown-GPU warning is given once per name
    yield
    hbm._from_datasheet.cache_clear()


def on_gpu(monkeypatch, name: str | None) -> None:
    monkeypatch.setattr(hbm, "gpu_name", lambda: name)


@pytest.mark.parametrize("name, tbps", [
    ("NVIDIA H200", 4.8),
    ("NVIDIA H200 NVL", 4.8),
    (H100, 3.35),
    ("NVIDIA H100 SXM5 80GB", 3.35),
    ("NVIDIA H100 PCIe", 2.0),
    ("NVIDIA H100 NVL", 3.9),
    ("NVIDIA H20", 4.0),
    ("NVIDIA GH200 480GB", 4.0),
    ("NVIDIA GH200 144G HBM3e", 4.9),
    ("NVIDIA A100-SXM4-80GB", 2.039),
    ("NVIDIA A100-SXM4-40GB", 1.555),
    ("NVIDIA A100-PCIE-40GB", 1.555),
    ("NVIDIA A100 80GB PCIe", 1.935),
    ("NVIDIA A100-PCIE-80GB", 1.935),
    ("NVIDIA L40S", 0.864),
    ("NVIDIA B200", 8.0),
    ("AMD Instinct MI300X", 5.3),
    ("nvidia h100 pcie", 2.0),  # case does not matter
], ids=lambda x: str(x))
def test_datasheet_figure_by_device_name(monkeypatch, name, tbps):
    assert hbm.datasheet_tbps(name)[0] == tbps
    on_gpu(monkeypatch, name)
    figure = hbm.hbm_bandwidth()
    assert (figure.tbps, figure.device, figure.known) == (tbps, name, True)
    assert str(figure).startswith(f"{tbps:g} TB/s ({name}: ") and str(figure).endswith(" datasheet)")


@pytest.mark.parametrize("name", ["NVIDIA H100", "NVIDIA GeForce RTX 4090", "NVIDIA A10G", "NVIDIA H800"])
def test_a_gpu_not_in_the_table_gets_the_h200_figure_and_says_so(monkeypatch, name):
    assert hbm.datasheet_tbps(name) is None
    on_gpu(monkeypatch, name)
    with pytest.warns(RuntimeWarning, match=f"{name!r} is not in pagedflash's HBM bandwidth table.*PAGEDFLASH_HBM_TBPS"):
        figure = hbm.hbm_bandwidth()
    assert (figure.tbps, figure.device, figure.known) == (hbm.H200_TBPS, name, False)
    assert "NOT this GPU's" in str(figure) and name in str(figure) and hbm.HBM_TBPS_ENV in str(figure)


def test_no_gpu_gets_the_h200_figure_named_as_such(monkeypatch):
    on_gpu(monkeypatch, None)
    figure = hbm.hbm_bandwidth()
    assert (figure.tbps, figure.device, figure.known) == (4.8, "cpu", True)
    assert "H200" in figure.source


@pytest.mark.parametrize("name", [H100, "NVIDIA GeForce RTX 4090", None])
def test_the_variable_overrides_any_device(monkeypatch, name):
    on_gpu(monkeypatch, name)
    monkeypatch.setenv(hbm.HBM_TBPS_ENV, " 1.008 ")
    figure = hbm.hbm_bandwidth()
    assert (figure.tbps, figure.device, figure.known) == (1.008, name or "cpu", True)
    assert str(figure) == f"1.008 TB/s (PAGEDFLASH_HBM_TBPS on {name or 'the CPU'})"


@pytest.mark.parametrize("raw", ["fast", "0", "-3.35", "nan", "inf", "3.35TB/s"])
def test_a_bad_override_is_refused_by_name(monkeypatch, raw):
    on_gpu(monkeypatch, H100)
    monkeypatch.setenv(hbm.HBM_TBPS_ENV, raw)
    with pytest.raises(ValueError, match=f"PAGEDFLASH_HBM_TBPS must be a positive number of TB/s.*got {raw!r}"):
        hbm.hbm_bandwidth()


def test_decode_step_bound_uses_the_device_figure(monkeypatch):
    on_gpu(monkeypatch, H100)
    assert bound_seconds(3.0e12, 0.35e12) == pytest.approx(1.0)
    assert bound_seconds(3.0e12, 0.35e12, gpus=2) == pytest.approx(0.5)
    monkeypatch.setenv(hbm.HBM_TBPS_ENV, "6.7")
    assert bound_seconds(3.0e12, 0.35e12) == pytest.approx(0.5)


def test_moe_bound_uses_the_device_figure(monkeypatch):
    weights = dict(w13=torch.zeros(4, 6, 5), w2=torch.zeros(4, 5, 3))
    topk_ids, x = torch.tensor([[0, 2], [2, 3]]), torch.zeros(2, 5)
    nbytes = moe.active_bytes(weights, topk_ids, x)
    assert nbytes == 3 * (6 * 5 + 5 * 3) * 4 + 2 * 10 * 4
    for name, tbps in ((H100, 3.35), ("NVIDIA H200", 4.8), (None, 4.8)):
        on_gpu(monkeypatch, name)
        assert moe.bound_ms(weights, topk_ids, x) == pytest.approx(nbytes / (tbps * 1e12) * 1e3)


def test_decode_columns_and_notes_name_the_figure(monkeypatch):
    on_gpu(monkeypatch, H100)
    assert decode.fp8_columns(torch.bfloat16)["of_peak"] == "of 3.35 TB/s"
    assert decode.fp8_note().endswith(f"of peak = fp8 TB/s / 3.35 TB/s ({H100}: H100 SXM 80 GB HBM3 datasheet).")


def test_moe_bench_note_and_result_file_record_the_figure(monkeypatch, tmp_path):
    on_gpu(monkeypatch, H100)
    # the figure is all this checks: each case's row without running it
    monkeypatch.setattr(moe, "case", lambda name, T, spec: ({"shape": name, "T": T, "speedup": common.NA,
                                                             "vs_dense": common.NA}, []))
    assert moe.main(common.Config(out=tmp_path, quick=True)) == 0
    doc = json.loads((tmp_path / "moe.json").read_text())
    assert f"tokens in and out at 3.35 TB/s ({H100}: H100 SXM 80 GB HBM3 datasheet)" in doc["tables"]["moe"]["note"]
    assert doc["env"]["hbm"] == {"tbps": 3.35, "device": H100, "source": f"{H100}: H100 SXM 80 GB HBM3 datasheet",
                                 "known": True}
    assert report.env_info(quick=True)["hbm"]["tbps"] == 3.35


def test_every_table_figure_is_positive_and_the_h200_is_the_fallback():
    """Every figure in the table is a positive, finite number of TB/s, and the H200's is the fallback's."""
    assert all(math.isfinite(t) and t > 0 for _, t, _ in hbm._DATASHEET_TBPS)
    assert hbm.datasheet_tbps("NVIDIA H200")[0] == hbm.H200_TBPS


def test_bench_serve_refuses_a_bad_override_before_running(monkeypatch, capsys):
    from pagedflash.bench import serve

    monkeypatch.setenv(hbm.HBM_TBPS_ENV, "0")
    assert serve.main(["--quick", "--sections", "itl", "--no-hf"]) == 2
    assert "bench serve: PAGEDFLASH_HBM_TBPS must be a positive number of TB/s (e.g. 3.35), got '0'" in \
        capsys.readouterr().err


@pytest.mark.parametrize("name", ["prefill", "overhead"])
def test_every_bench_refuses_a_bad_override_before_running(monkeypatch, capsys, tmp_path, name):
    """Benches that print no bound still write env.hbm: the CLI refuses a bad value before running
    them, not when the result file is written after the run."""
    from pagedflash import cli

    monkeypatch.setenv(hbm.HBM_TBPS_ENV, "fast")
    assert cli.main(["bench", name, "--quick", "--out", str(tmp_path)]) == 2
    assert "pagedflash bench: PAGEDFLASH_HBM_TBPS must be a positive number of TB/s (e.g. 3.35), got 'fast'" in \
        capsys.readouterr().err
    assert not list(tmp_path.iterdir())

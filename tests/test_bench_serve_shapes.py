"""``bench serve --shape``: the named configs (:mod:`pagedflash.bench.shapes`) are the published ones
(parameter counts of Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B, OLMoE-1B-7B and GPT-OSS-20B); ``--quick --shape gpt-oss-20b`` builds the
family at tiny sizes in memory and runs ``itl`` and ``throughput``, its ``% of bound`` counting the
routed experts only; bad combinations are refused by name."""

import json

import pytest
import torch

from pagedflash.bench import serve
from pagedflash.bench.decode_bound import bound_seconds, bytes_read, kv_read
from pagedflash.bench.shapes import SHAPES, shape_config, tiny
from pagedflash.engine import ModelConfig


@pytest.mark.parametrize("name, total, active, layers", [("qwen3-30b-a3b", 30.53e9, 3.35e9, 48),
                                                          ("qwen1.5-moe-a2.7b", 14.32e9, 2.69e9, 24),
                                                          ("olmoe-1b-7b", 6.919e9, 1.282e9, 16),
                                                          ("gpt-oss-20b", 20.91e9, 4.19e9, 24)])
def test_moe_shapes_are_the_published_models(name, total, active, layers):
    config = ModelConfig.from_dict(SHAPES[name])
    assert config.num_parameters() == pytest.approx(total, rel=1e-3)
    assert config.num_active_parameters() == pytest.approx(active, rel=1e-3)
    assert config.num_layers == layers and not config.tie_word_embeddings and not config.dense_layers
    small = ModelConfig.from_dict(shape_config(name, small=True))
    assert (small.architecture, small.num_experts, small.num_experts_per_tok) == (config.architecture, 4, 2)
    assert small.layer_types == config.layer_types[:2]  # GPT-OSS: sliding, full; Qwen3-MoE: none
    assert small.sliding_window == (16 if config.sliding_window else None)
    assert tiny(SHAPES[name]) == shape_config(name, small=True)


def test_quick_shape_runs_itl_and_throughput_with_the_routed_bound(tmp_path, monkeypatch):
    for key, value in dict(num_requests=2, output=(2, 2), itl_batches=(1,), itl_contexts=(8,), itl_tokens=3).items():
        monkeypatch.setitem(serve.QUICK, key, value)
    monkeypatch.setattr(serve, "_warm", lambda *args: None)  # no timing figure is read here
    assert serve.main(["--quick", "--shape", "gpt-oss-20b", "--sections", "itl,throughput", "--no-hf",
                       "--max-model-len", "64", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "serve.json").read_text())
    assert doc["summary"]["model"] == "gpt-oss-20b"
    assert doc["tables"]["throughput"]["rows"][0]["tok_s"] > 0
    config = ModelConfig.from_dict(shape_config("gpt-oss-20b", small=True))
    weights, kv = bytes_read(config, {}, on_gpu=torch.cuda.is_available())  # bf16 on a GPU
    assert weights < 4 * (config.num_parameters() - config.vocab_size * config.hidden_size)  # 2 of 4 experts
    rows = doc["tables"]["itl"]["rows"]
    assert [(r["graphs"], r["batch"], r["context"]) for r in rows] == [("on", 1, 8), ("off", 1, 8)]
    for row in rows:
        assert row["bound_ms"] == pytest.approx(1e3 * bound_seconds(weights, kv_read(config, kv, 8 + 3 / 2)))
        assert row["pct_bound"] == pytest.approx(row["bound_ms"] / row["itl_ms"] * 100)


@pytest.mark.parametrize("argv, message", [
    (["--sections", "throughput"], "--shape qwen3-30b-a3b builds the engine in memory, with no checkpoint"),
    (["--sections", "itl", "--model", "/nowhere"], "--shape qwen3-30b-a3b and --model /nowhere both name the model"),
    (["--sections", "itl", "--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
])
def test_bad_shape_arguments_are_refused(capsys, argv, message):
    assert serve.main(["--quick", "--shape", "qwen3-30b-a3b", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unknown_shape_is_refused(capsys):
    with pytest.raises(SystemExit):
        serve.main(["--quick", "--shape", "qwen3-31b"])
    assert "invalid choice: 'qwen3-31b'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="shape must be one of .* got 'nope'"):
        shape_config("nope")

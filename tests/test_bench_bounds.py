"""The bytes a decode step reads: the denominator of the benches' memory-bandwidth bounds."""

import json

import pytest
import torch

from benchmarks.common import decode_read_bytes
from vramshard.models import build_model
from vramshard.shapes import shape_config, shape_model


def test_decode_reads_every_weight_but_an_untied_embedding_table_plus_the_kv_cache():
    model = shape_model("nemo-8b")
    config = shape_config("nemo-8b")
    table = config["vocab_size"] * config["hidden_size"] * 2  # fp16
    assert decode_read_bytes(model) == model.nbytes - table
    assert decode_read_bytes(model, 1024) == model.nbytes - table + 1024 * model.kv_bytes_per_token()


def test_a_head_tied_to_the_embedding_still_reads_the_table():
    config = dict(shape_config("nemo-8b"), tie_word_embeddings=True)
    model = build_model(config, torch.float16)
    assert decode_read_bytes(model) == model.nbytes


def test_cpu_read_method_times_every_method_and_its_steps(tmp_path):
    from benchmarks import cpu_read_method

    out = tmp_path / "read.json"
    result = cpu_read_method.main(["--gib", "0.004", "--shape", "256,512", "--dtypes", "fp32", "--rounds", "2",
                                   "--calls", "4", "--json", str(out)])
    row = result["dtypes"]["fp32"]
    assert set(row["gb_s"]) == set(cpu_read_method.METHODS) and all(v > 0 for v in row["gb_s"].values())
    assert row["weights"] == int(0.004 * 2**30 // (256 * 512 * 4)) and 1 <= row["ring_weights"] <= row["weights"]
    steps = row["ring_size_effect"] * row["statistic_effect"] * row["fresh_clones_effect"]
    assert abs(steps - row["profile_over_walk"]) < 1e-9 * row["profile_over_walk"]  # the steps multiply out
    assert json.loads(out.read_text())["shape"] == [256, 512]
    with pytest.raises(SystemExit, match="unknown dtype"):
        cpu_read_method.main(["--dtypes", "int4", "--gib", "0.001", "--shape", "8,8"])

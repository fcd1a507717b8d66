"""The bytes a decode step reads: the denominator of the benches' memory-bandwidth bounds."""

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

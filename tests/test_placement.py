"""Placements as plain data, VRAM arithmetic and budget refusal (CPU only)."""

import pytest

from vramshard import Engine
from vramshard.errors import BudgetError, InvalidInputError
from vramshard.models import build_model
from vramshard.plan.memory import max_resident_layers, sublayer_triples, vram_need
from vramshard.plan.placement import GPU_RESIDENT, Placement, Where, named_placement
from vramshard.runtime.executor import Executor
from vramshard.runtime.host_weights import pack_model
from vramshard.runtime.weights import load_weights
from vramshard.loading.checkpoint import open_checkpoint

from placement_helpers import trace_logits


@pytest.fixture
def model(tiny_model_dir):
    return build_model(open_checkpoint(tiny_model_dir("llama")).config)


@pytest.mark.parametrize("spec", ["cpu", "gpu", "stream", "static", "layers:0", "layers:1", "layers:2"])
def test_named_placements_round_trip(model, spec):
    placement = named_placement(spec, sublayer_triples(model), model.args.num_hidden_layers)
    assert Placement.from_json(placement.to_json()) == placement
    assert [n for n, _ in placement.where] == [s.name for s in model]
    assert spec.split(":")[0] in str(placement)


def test_named_placement_contents(model):
    triples, layers = sublayer_triples(model), model.args.num_hidden_layers
    static = named_placement("static", triples, layers)
    assert static["attn[0]"] == GPU_RESIDENT and static["ffn[0]"].compute == "cpu"
    one = named_placement("layers:1", triples, layers)
    assert one["attn[0]"] == GPU_RESIDENT and one["ffn[0]"] == GPU_RESIDENT
    assert one["attn[1]"].compute == "cpu" and one["head"].compute == "cpu"
    assert named_placement("layers:2", triples, layers)["head"] == GPU_RESIDENT
    stream = named_placement("stream", triples, layers)
    assert stream["embed"].compute == "cpu" and stream.names(home="stream")[0] == "attn[0]"


def test_bad_placements(model):
    triples, layers = sublayer_triples(model), model.args.num_hidden_layers
    with pytest.raises(InvalidInputError, match="unknown placement 'fast'"):
        named_placement("fast", triples, layers)
    with pytest.raises(InvalidInputError, match="0 <= N <= 2"):
        named_placement("layers:3", triples, layers)
    with pytest.raises(InvalidInputError, match="invalid placement"):
        Where("cpu", "vram")
    with pytest.raises(InvalidInputError, match="not a placement"):
        Placement.from_json("{}")


def test_vram_need_counts_each_part(model):
    triples, layers = sublayer_triples(model), model.args.num_hidden_layers
    gpu = vram_need(model, named_placement("gpu", triples, layers), 1, 64, 16)
    stream = vram_need(model, named_placement("stream", triples, layers), 1, 64, 16, num_slots=3)
    static = vram_need(model, named_placement("static", triples, layers), 1, 64, 16)
    cpu = vram_need(model, named_placement("cpu", triples, layers), 1, 64, 16)
    assert gpu.resident >= model.nbytes and gpu.slots == 0
    largest = max(s.nbytes for s in model if s.kind != "embed")
    assert stream.resident == 0 and stream.slots >= 3 * largest
    assert static.resident == sum(s.nbytes for s in model.attention_layers) or static.resident > 0
    kv_per_token = model.kv_bytes_per_token()
    assert gpu.kv == 64 * kv_per_token == static.kv
    assert cpu.total == 0


def test_budget_refusal_says_how_much(model, tiny_model_dir):
    triples, layers = sublayer_triples(model), model.args.num_hidden_layers
    host = pack_model(list(model), load_weights(model, open_checkpoint(tiny_model_dir("llama"))), pin=False)
    with pytest.raises(BudgetError, match=r"needs .* of VRAM .* raise --vram to at least"):
        Executor(model, host, named_placement("gpu", triples, layers), budget=1024)


def test_max_resident_layers_fits_budget(model):
    triples, layers = sublayer_triples(model), model.args.num_hidden_layers
    one = vram_need(model, named_placement("layers:1", triples, layers), 1, 64, 16).total
    assert max_resident_layers(model, one, 1, 64, 16) == 1
    assert max_resident_layers(model, one - 1, 1, 64, 16) == 0


def test_cpu_engine_needs_no_gpu_and_chunked_prefill_matches(tiny_model_dir):
    engine = Engine.load(tiny_model_dir("qwen3"), device="cpu", max_step_tokens=5)
    assert engine.executor.placement.name == "cpu"
    whole = trace_logits(engine)
    chunked = trace_logits(engine, prefill_chunk=5)
    assert (whole - chunked).abs().max() < 1e-4
    # generate() prefills in steps of 5 tokens here, and must equal one-step prefill.
    wide = Engine.load(tiny_model_dir("qwen3"), device="cpu")
    assert engine.generate([list(range(1, 13))], 8) == wide.generate([list(range(1, 13))], 8)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_gpu_placement_without_gpu_is_a_clear_error(tiny_model_dir):
    with pytest.raises(InvalidInputError, match="no CUDA GPU"):
        Engine.load(tiny_model_dir("llama"), device="cuda")


def test_thread_count_of_one_executor_does_not_leak_into_the_next(model, tiny_model_dir):
    import torch

    triples, layers = sublayer_triples(model), model.args.num_hidden_layers
    host = pack_model(list(model), load_weights(model, open_checkpoint(tiny_model_dir("llama"))), pin=False)
    cpu = named_placement("cpu", triples, layers)
    default = torch.get_num_threads()
    try:
        Executor(model, host, cpu, device="cpu", threads=1)
        assert torch.get_num_threads() == 1
        Executor(model, host, cpu, device="cpu")  # asked for none: back to all cores
        assert torch.get_num_threads() == default
    finally:
        torch.set_num_threads(default)

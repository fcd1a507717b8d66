"""A MoE layer's routed experts read by GPU kernels from host memory (runtime/zero_copy_experts.py):
the kernels interpreted on the CPU (Triton's interpreter) against the layer's own expert paths."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

try:
    import triton
except ImportError:  # (the tests that need it skip)
    triton = None

from vramshard.layers.moe import DictExperts, Routing, StackedExperts, stack_experts
from vramshard.loading.checkpoint import open_checkpoint
from vramshard.models import build_model
from vramshard.plan.memory import moe_layers
from vramshard.runtime import zero_copy_experts
from vramshard.runtime.host_weights import pack_model
from vramshard.runtime.weights import load_weights

from switch_helpers import assert_opt_out

needs_triton = pytest.mark.skipif(zero_copy_experts.triton is None, reason="needs Triton")


def _in_interpreter(test: str) -> None:
    """Run ``test`` of this file in a fresh process with Triton's interpreter (read at import)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{test}"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def reference(gate_up: torch.Tensor, down: torch.Tensor, h: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each token's sum of weight × SwiGLU over its experts, in float32, expert by expert."""
    out = torch.zeros(h.shape, dtype=torch.float32)
    for t in range(h.shape[0]):
        for e, w in zip(routing.experts[t].tolist(), routing.weights[t].float().tolist()):
            gate, up = F.linear(h[t].float(), gate_up[e].float()).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, down[e].float())
    return out


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_compute_each_tokens_routed_experts(dtype, request):
    """Experts at a padded stride in one buffer (as a host layout lays them), widths that are not
    multiples of the kernels' blocks, a token routed twice to one expert's neighbour, and two tokens
    sharing an expert: the float32 reference, within the dtype's rounding."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        _in_interpreter(request.node.name)
        return
    torch.manual_seed(0)
    E, D, Fw, pad = 6, 72, 40, 24  # D, F: not multiples of BLOCK_K; pad: elements between experts
    gate_up_numel, down_numel = 2 * Fw * D, D * Fw
    stride = gate_up_numel + down_numel + pad
    buffer = (torch.randn(E * stride) * 0.2).to(dtype)
    gate_up = buffer.as_strided((E, 2 * Fw, D), (stride, D, 1))
    down = buffer[gate_up_numel:].as_strided((E, D, Fw), (stride, Fw, 1))
    h = (torch.randn(3, D)).to(dtype)
    routing = Routing(torch.tensor([[0, 5], [5, 2], [1, 0]]), torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]]).to(dtype))
    got = zero_copy_experts.routed_experts(StackedExperts(gate_up, down), h, routing)
    assert got.dtype == dtype and got.shape == h.shape
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), reference(gate_up, down, h, routing), rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="do not fit"):
        zero_copy_experts.routed_experts(StackedExperts(gate_up, down), h[:, :-1], routing)


@needs_triton
def test_with_a_cache_the_kernels_read_cached_experts_from_their_slots_and_the_rest_from_host(request):
    """A slot table sends each cached expert to its slot, the others to host memory. The slots here
    hold *other* weights than host memory for the same experts, so reading the wrong side shows."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        _in_interpreter(request.node.name)
        return
    torch.manual_seed(2)
    E, D, Fw, slots = 6, 40, 24, 3
    host = StackedExperts(torch.randn(E, 2 * Fw, D) * 0.2, torch.randn(E, D, Fw) * 0.2)
    cache = StackedExperts(torch.randn(slots, 2 * Fw, D) * 0.2, torch.randn(slots, D, Fw) * 0.2)
    slot_of = torch.tensor([-1, 2, -1, 0, -1, -1], dtype=torch.int32)  # experts 1 and 3 cached
    h = torch.randn(2, D)
    routing = Routing(torch.tensor([[1, 0], [3, 5]]), torch.tensor([[0.6, 0.4], [0.5, 0.5]]))
    seen_gate_up, seen_down = host.gate_up.clone(), host.down.clone()  # what each expert reads as
    for e, slot in ((1, 2), (3, 0)):
        seen_gate_up[e], seen_down[e] = cache.gate_up[slot], cache.down[slot]
    got = zero_copy_experts.routed_experts(host, h, routing, zero_copy_experts.CachedSource(cache, slot_of))
    torch.testing.assert_close(got, reference(seen_gate_up, seen_down, h, routing), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="slot table"):
        zero_copy_experts.routed_experts(host, h, routing, zero_copy_experts.CachedSource(cache, slot_of[:4]))


@needs_triton
@pytest.mark.parametrize("with_cache", [False, True])
def test_assignments_to_expert_minus_one_are_left_to_the_cpu_and_count_zero(with_cache, request):
    """The CPU's share of a step: assignments marked -1 add nothing (the rest as the reference of
    the rest), with and without a slot table; the CPU's sum over the marked ones completes it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        _in_interpreter(request.node.name)
        return
    torch.manual_seed(4)
    E, D, Fw = 5, 40, 24
    host = StackedExperts(torch.randn(E, 2 * Fw, D) * 0.2, torch.randn(E, D, Fw) * 0.2)
    h = torch.randn(3, D)
    routing = Routing(torch.tensor([[1, 0], [3, 4], [0, 2]]), torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.3, 0.7]]))
    on_cpu = torch.tensor([[False, True], [True, False], [True, True]])  # token 2 wholly on the CPU
    cache = zero_copy_experts.CachedSource(host, torch.arange(E, dtype=torch.int32)) if with_cache else None
    gpu_part = Routing(routing.experts.masked_fill(on_cpu, -1), routing.weights)
    got = zero_copy_experts.routed_experts(host, h, gpu_part, cache)
    kept = Routing(routing.experts, routing.weights.masked_fill(on_cpu, 0.0))
    torch.testing.assert_close(got, reference(host.gate_up, host.down, h, kept), rtol=1e-4, atol=1e-4)
    assert got[2].abs().max() == 0
    cpu_part = Routing(routing.experts, routing.weights.masked_fill(~on_cpu, 0.0))
    torch.testing.assert_close(got + reference(host.gate_up, host.down, h, cpu_part),
                               reference(host.gate_up, host.down, h, routing), rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_kernels_read_a_models_host_layout_as_its_expert_paths_do(arch, tiny_model_dir, request):
    """A tiny model's MoE layers packed for the host, stacked as the executor stacks them: the same
    output as the layer's own path over the same host experts, for one token and for four."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        _in_interpreter(request.node.name)
        return
    path = tiny_model_dir(arch)
    model = build_model(open_checkpoint(path).config)
    host = pack_model(list(model), load_weights(model, open_checkpoint(path)), pin=False)
    names = [s.name for s in model if s.layer in moe_layers(model) and s.kind == "ffn"]
    assert names
    torch.manual_seed(1)
    for name in names:
        sublayer, views = model[name], host[name].views
        stacked = stack_experts(views, sublayer.num_experts)
        assert stacked is not None, "the host layout does not stack: the executor would not read it by the GPU"
        for rows in (1, zero_copy_experts.ROWS):
            x = torch.randn(rows, sublayer.hidden).to(model.dtype)
            h, routing = sublayer.prepare(views, x)
            expected = sublayer.run_experts(DictExperts(views, sublayer.num_experts), h, routing)
            got = zero_copy_experts.routed_experts(stacked, h, routing)
            torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@needs_triton
def test_the_kernels_read_a_cache_laid_out_as_the_gpus_with_its_slot_table(tiny_model_dir, request):
    """The cache's own slot layout (ExpertSlotBuffer, as ExpertSlots lays it out in VRAM) and slot
    table (ExpertCache.slots_of, whose version moves with every fill and eviction): the kernels
    give the layer's own output whichever experts are cached."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        _in_interpreter(request.node.name)
        return
    from vramshard.plan.memory import expert_slot_bytes
    from vramshard.runtime.expert_cache import ExpertCache
    from vramshard.runtime.streaming import ExpertSlotBuffer

    class Slots(ExpertSlotBuffer):  # filled at once on the CPU
        def fill(self, slot, name, expert):
            target, source = self.target(slot, name, expert)
            return target.copy_(source).numel()

        def ready(self, slot):
            pass

        def done(self, slot):
            pass

    path = tiny_model_dir("qwen3_moe")
    model = build_model(open_checkpoint(path).config)
    host = pack_model(list(model), load_weights(model, open_checkpoint(path)), pin=False)
    name = next(s.name for s in model if s.layer in moe_layers(model) and s.kind == "ffn")
    sublayer, views = model[name], host[name].views
    cache = ExpertCache(3, Slots(3, expert_slot_bytes(model), host, torch.device("cpu")))
    torch.manual_seed(3)
    x = torch.randn(2, sublayer.hidden).to(model.dtype)
    h, routing = sublayer.prepare(views, x)
    expected = sublayer.run_experts(DictExperts(views, sublayer.num_experts), h, routing)
    versions = [cache.version]
    for ids in ([0, 1, 2], [5], [3, 4]):  # fills, then evictions
        cache.gather(name, ids)
        versions.append(cache.version)
        table = torch.tensor(cache.slots_of(name, sublayer.num_experts), dtype=torch.int32)
        assert sorted(t for t in table.tolist() if t >= 0) == sorted(cache.slot_of[k] for k in cache.slot_of)
        source = zero_copy_experts.CachedSource(cache.copier.stacked(name), table)
        got = zero_copy_experts.routed_experts(stack_experts(views, sublayer.num_experts), h, routing, source)
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert versions == sorted(versions) and len(set(versions)) == len(versions)


@needs_triton
def test_a_larger_step_copies_its_missing_experts_in_once_and_reads_them_all_from_the_slots(tiny_model_dir, request):
    """Steps of more than ROWS tokens (a decode batch of 16, say) through the cache: every routed
    expert made cached (each missing one copied once), then the kernels over the slots alone give
    the layer's own output; a second step of the same experts copies nothing; a cache too small
    for the step's experts does nothing and leaves the step to the caller's path."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        _in_interpreter(request.node.name)
        return
    from vramshard.plan.memory import expert_slot_bytes
    from vramshard.runtime.expert_cache import CachedExperts, ExpertCache
    from vramshard.runtime.streaming import ExpertSlotBuffer

    class Slots(ExpertSlotBuffer):  # filled at once on the CPU, fills and releases counted
        fills, released = 0, 0

        def fill(self, slot, name, expert):
            Slots.fills += 1
            target, source = self.target(slot, name, expert)
            return target.copy_(source).numel()

        def ready(self, slot):
            pass

        def done(self, slot):
            Slots.released += 1

    path = tiny_model_dir("qwen3_moe")
    model = build_model(open_checkpoint(path).config)
    host = pack_model(list(model), load_weights(model, open_checkpoint(path)), pin=False)
    name = next(s.name for s in model if s.layer in moe_layers(model) and s.kind == "ffn")
    sublayer, views = model[name], host[name].views
    layout = stack_experts(views, sublayer.num_experts)
    torch.manual_seed(5)
    x = torch.randn(zero_copy_experts.ROWS + 4, sublayer.hidden).to(model.dtype)
    h, routing = sublayer.prepare(views, x)
    wanted = sorted(set(routing.experts.reshape(-1).tolist()))
    assert len(wanted) > 2
    expected = sublayer.run_experts(DictExperts(views, sublayer.num_experts), h, routing)
    cache = ExpertCache(len(wanted) + 1, Slots(len(wanted) + 1, expert_slot_bytes(model), host, torch.device("cpu")))
    source = CachedExperts({}, name, cache)
    for step in range(2):
        got = zero_copy_experts.routed_through_cache(layout, h, routing, source.gather)
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
        assert Slots.fills == len(wanted)  # each missing expert once, and none on the second step
        assert (cache.stats.hits, cache.stats.misses) == (step * len(wanted), len(wanted))
        assert Slots.released == (step + 1) * len(wanted)  # the slots are given back after each step
    small = ExpertCache(2, Slots(2, expert_slot_bytes(model), host, torch.device("cpu")))
    assert zero_copy_experts.routed_through_cache(layout, h, routing, CachedExperts({}, name, small).gather) is None
    assert not small.slot_of and small.stats.misses == 0


@needs_triton
@pytest.mark.parametrize("has_cache", [False, True])
def test_the_kernels_compile_for_a_gpu(has_cache):
    """Triton's compiler takes both kernels, with and without the cache's slot table, down to PTX
    for an H100/H200-class GPU (sm_90), no GPU needed: what the interpreter does not check (types
    of the selected pointers, the constexpr branches) fails here before a GPU run would."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter compiles nothing")
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        pytest.skip(f"Triton {triton.__version__}'s ASTSource takes no constexprs")

    common = {"experts_ptr": "*i32", "w_ptr": "*bf16", "D": "i32", "F": "i32", "stride_e": "i64", "stride_r": "i32",
              "slot_ptr": "*i32", "cache_ptr": "*bf16", "cache_stride_e": "i64", "BLOCK_K": "constexpr",
              "HAS_CACHE": "constexpr"}
    kernels = (
        (zero_copy_experts._gate_up_act, {"h_ptr": "*bf16", "act_ptr": "*fp32", "top_k": "i32", "BLOCK_F": "constexpr"},
         {"BLOCK_F": zero_copy_experts.BLOCK_F}),
        (zero_copy_experts._down, {"act_ptr": "*fp32", "weights_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK_D": "constexpr"},
         {"BLOCK_D": zero_copy_experts.BLOCK_D}),
    )
    for kernel, own, blocks in kernels:
        names = kernel.arg_names
        signature = {name: {**common, **own}[name] for name in names}
        constexprs = {"BLOCK_K": zero_copy_experts.BLOCK_K, "HAS_CACHE": has_cache, **blocks}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert ".entry" in compiled.asm["ptx"]


def test_zero_copy_experts_are_on_unless_switched_off(monkeypatch):
    """On (where supported) unless VRAMSHARD_EXPERTS_ZERO_COPY=off (read when the module is imported)."""
    assert_opt_out(monkeypatch, zero_copy_experts, "VRAMSHARD_EXPERTS_ZERO_COPY")


@needs_triton
def test_gpus_older_than_ampere_compute_host_experts_on_the_cpu(monkeypatch):
    """On by default must not mean a kernel that fails on a GPU it was never meant for: below
    compute capability 8.0 (an RTX 20xx, say) the kernels are not supported, and so not used."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(zero_copy_experts, "ENABLED", True)
    for capability, expected in (((7, 5), False), ((8, 0), True), ((8, 6), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        assert zero_copy_experts.supported() is expected and zero_copy_experts.available() is expected

"""MoE: grouped/gathered/cached expert math against transformers, routing ties, the expert
cache policy with a fake copier, MoE placements as data, the planner's MoE families, and
(on a GPU) every MoE placement against the CPU reference."""

import pytest
import torch

from tiny_models import make_hf_model
from vramshard import Engine
from vramshard.errors import BudgetError, InvalidInputError
from vramshard.layers.moe import DictExperts, ExpertTensors, MoEFFN, Routing, stack_experts
from vramshard.layers.step import Step
from vramshard.loading.checkpoint import open_checkpoint
from vramshard.models import build_model
from vramshard.plan.memory import (expert_slot_bytes, main_piece_bytes, moe_layers, split_router_bytes,
                                   sublayer_triples, tiered_vram_need, vram_need)
from vramshard.plan.placement import (EXPERTS_CACHED, EXPERTS_CPU, Placement, TieredPlacement, Where,
                                      named_placement)
from vramshard.plan.planner import MOE_FAMILIES, Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile.query import synthetic
from vramshard.runtime.expert_cache import CachedExperts, ExpertCache, FrequencyRecency
from vramshard.runtime import run_ahead, zero_copy_experts
from vramshard.runtime.executor import Executor
from vramshard.runtime.streaming import ExpertSlotBuffer
from vramshard.runtime.host_weights import pack_model
from vramshard.runtime.weights import load_weights
from vramshard.shapes import shape_model

from placement_helpers import PROMPT, trace_logits

MOE_ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"]
# The GPU's MoE paths by architecture: OLMoE differs from Qwen3-MoE only in attention math, which
# test_executor_gpu runs on the GPU for every architecture; Qwen2-MoE's shared expert runs on the GPU
# with the router where a layer splits.
GPU_MOE_ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe"]
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class FakeCopier:
    """Copies experts on the CPU, recording every call (the ExpertSlots protocol without CUDA)."""

    def __init__(self, host, capacity):
        self.host = host
        self.slots = [None] * capacity
        self.log = []

    def fill(self, slot, name, expert):
        views = self.host[name].views
        self.slots[slot] = (name, expert, ExpertTensors(*(views[f"experts.{expert}.{p}"].clone()
                                                          for p in ("gate", "up", "down"))))
        self.log.append(("fill", slot, name, expert))
        return 3

    def ready(self, slot):
        self.log.append(("ready", slot))

    def done(self, slot):
        self.log.append(("done", slot))

    def view(self, slot, name):
        assert self.slots[slot][0] == name
        return self.slots[slot][2]


class BufferCopier(ExpertSlotBuffer):
    """The slots of the VRAM cache laid out as on the GPU, filled at once on the CPU."""

    def __init__(self, host, capacity, slot_bytes):
        super().__init__(capacity, slot_bytes, host, torch.device("cpu"))
        self.log = []

    def fill(self, slot, name, expert):
        target, source = self.target(slot, name, expert)
        target.copy_(source)
        self.log.append(("fill", slot, name, expert))
        return target.numel()

    def ready(self, slot):
        self.log.append(("ready", slot))

    def done(self, slot):
        self.log.append(("done", slot))


def loaded(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    model = build_model(open_checkpoint(path).config)
    host = pack_model(list(model), load_weights(model, open_checkpoint(path)), pin=False)
    return path, model, host


# ---------------------------------------------------------------------------------------- math
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_paths_agree(arch, tiny_model_dir):
    """Grouped (plain mapping), fused gate_up, stacked gather and cache-fed experts: one result."""
    _, model, host = loaded(tiny_model_dir, arch)
    ffn = next(s for s in model if isinstance(s, MoEFFN))
    views = host[ffn.name].views
    assert "experts.0.gate_up" in views  # free fused view in the packed buffer
    torch.manual_seed(0)
    x = torch.randn(7, model.args.hidden_size)
    step = Step.single(0, 7)
    plain = {k: v for k, v in views.items() if not k.endswith("gate_up")}
    expected = ffn.forward(plain, x, step)
    torch.testing.assert_close(ffn.forward(views, x, step), expected, rtol=1e-5, atol=1e-5)
    stacked = DictExperts(views, ffn.num_experts, stack=True)
    assert stacked.stacked() is not None and stacked.stacked().gate_up.shape[0] == ffn.num_experts
    torch.testing.assert_close(ffn.forward(stacked, x, step), expected, rtol=1e-5, atol=1e-5)
    cache = ExpertCache(2, FakeCopier(host, 2))  # fewer slots than hit experts: evicts mid-layer
    torch.testing.assert_close(ffn.forward(CachedExperts(views, ffn.name, cache), x, step), expected,
                               rtol=1e-5, atol=1e-5)
    assert cache.stats.misses > 2 and cache.stats.evictions > 0


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_cached_experts_of_a_few_tokens_run_together_from_the_slots(arch, tiny_model_dir):
    """Decode-sized steps read all their experts from the cache slots at once (one gather, no
    per-expert kernels); the result equals the per-expert path, copies come first and every slot
    read is released; with fewer slots than experts the step falls back to one expert at a time."""
    _, model, host = loaded(tiny_model_dir, arch)
    ffn = next(s for s in model if isinstance(s, MoEFFN))
    views = host[ffn.name].views
    plain = {k: v for k, v in views.items() if not k.endswith("gate_up")}
    slot_bytes = expert_slot_bytes(model)
    torch.manual_seed(1)
    for tokens in (1, 3):
        x = torch.randn(tokens, model.args.hidden_size)
        step = Step.single(0, tokens)
        expected = ffn.forward(plain, x, step)
        copier = BufferCopier(host, ffn.num_experts, slot_bytes)
        cache = ExpertCache(ffn.num_experts, copier)
        fetched = []
        original = cache.fetch
        cache.fetch = lambda name, ids: fetched.append(ids) or original(name, ids)
        for repeat in range(2):  # the second time every expert is a hit
            got = ffn.forward(CachedExperts(views, ffn.name, cache), x, step)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert fetched == []  # never one expert at a time
        used = len({e for e in range(ffn.num_experts) if (ffn.name, e) in cache})
        assert cache.stats.misses == used and cache.stats.hits == used
        log = copier.log
        assert all(log.index(("ready", s)) > log.index(("fill", s, ffn.name, e))
                   for (name, e), s in cache.slot_of.items())
        assert sum(1 for entry in log if entry[0] == "done") == 2 * used
    small = ExpertCache(1, BufferCopier(host, 1, slot_bytes))  # fewer slots than a token's experts
    x = torch.randn(1, model.args.hidden_size)
    torch.testing.assert_close(ffn.forward(CachedExperts(views, ffn.name, small), x, Step.single(0, 1)),
                               ffn.forward(plain, x, Step.single(0, 1)), rtol=1e-5, atol=1e-5)
    assert small.stats.evictions > 0


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_experts_of_a_step_split_between_sources_sum_to_the_whole(arch, tiny_model_dir):
    """``only``: each source computes its share of the assignments; the shares add up to the
    full result on every path (grouped, stacked gather, cache gather)."""
    _, model, host = loaded(tiny_model_dir, arch)
    ffn = next(s for s in model if isinstance(s, MoEFFN))
    views = host[ffn.name].views
    torch.manual_seed(2)
    for tokens in (1, 5):
        x = torch.randn(tokens, model.args.hidden_size)
        h, routing = ffn.prepare(views, x)
        used = sorted(set(routing.experts.reshape(-1).tolist()))
        first, rest = set(used[: len(used) // 2]), set(used[len(used) // 2 :])
        whole = ffn.run_experts(DictExperts(views, ffn.num_experts), h, routing)
        cache = ExpertCache(ffn.num_experts, BufferCopier(host, ffn.num_experts, expert_slot_bytes(model)))
        for source in (DictExperts(views, ffn.num_experts), DictExperts(views, ffn.num_experts, stack=True),
                       CachedExperts(views, ffn.name, cache)):
            parts = ffn.run_experts(source, h, routing, only=first) + ffn.run_experts(source, h, routing, only=rest)
            torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)
            assert torch.count_nonzero(ffn.run_experts(source, h, routing, only=set())) == 0
        assert {e for (_, e) in cache.slot_of} == set(used)  # the cache copied exactly the experts asked for
        # Split by routing position (each token's first expert and the rest, as the zero-copy
        # kernels' CPU share): a narrower routing computes its share on every host path.
        first_of, rest_of = (Routing(routing.experts[:, part], routing.weights[:, part])
                             for part in (slice(0, 1), slice(1, None)))
        for source in (DictExperts(views, ffn.num_experts), DictExperts(views, ffn.num_experts, stack=True)):
            parts = ffn.run_experts(source, h, first_of) + ffn.run_experts(source, h, rest_of)
            torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


def test_cache_picks_least_used_misses_and_counts_work_done_elsewhere(tiny_model_dir):
    _, model, host = loaded(tiny_model_dir, "qwen3_moe")
    cache = ExpertCache(4, FakeCopier(host, 4))
    for _ in range(3):
        list(cache.fetch("ffn[0]", [1]))
    cache.note_computed_elsewhere("ffn[0]", [2])
    assert cache.least_used("ffn[0]", [1, 2, 3], 2) == [3, 2]  # never used, used once; not 1 (used 3x)
    assert cache.least_used("ffn[0]", [1, 2], 0) == []
    assert ("ffn[0]", 2) not in cache  # computed elsewhere: not copied in
    assert (cache.stats.hits, cache.stats.misses, cache.stats.elsewhere) == (2, 2, 1)
    before = cache.stats.copy()
    cache.note_computed_elsewhere("ffn[0]", [5, 6])
    assert cache.stats.minus(before).elsewhere == 2


def test_stacking_needs_uniform_layout():
    a = torch.zeros(8, 6)
    uneven = {"experts.0.gate_up": a[0:2], "experts.1.gate_up": a[2:4], "experts.2.gate_up": a[4:6],
              "experts.0.down": a[6:7], "experts.1.down": a[7:8], "experts.2.down": a[0:1]}
    assert stack_experts(uneven, 3) is None  # down of expert 2 is not at the stride of the others
    assert stack_experts({k: v for k, v in uneven.items() if k != "experts.2.gate_up"}, 3) is None
    buf = torch.arange(24.0)
    w = {"experts.0.gate_up": buf[0:4].view(2, 2), "experts.1.gate_up": buf[6:10].view(2, 2),
         "experts.0.down": buf[4:6].view(2, 1), "experts.1.down": buf[10:12].view(2, 1)}
    s = stack_experts(w, 2)
    assert torch.equal(s.gate_up[1], w["experts.1.gate_up"]) and torch.equal(s.down[1], w["experts.1.down"])


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_cpu_engine_matches_transformers_with_routing_ties(arch, tmp_path):
    """The first MoE layer's router (of two or more) has all rows zero (every score tied); the last one's has
    three identical rows (three experts tied). The engine must route exactly as transformers
    (torch.topk order) and give its logits."""
    hf = make_hf_model(arch)
    routers = {i: layer.mlp.gate for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")}
    last = max(routers)
    first_layer = min(routers)
    with torch.no_grad():
        if first_layer != last:
            routers[first_layer].weight.zero_()
        weight = routers[last].weight
        weight[0] *= 4
        weight[1] = weight[3] = weight[0]  # three rows tied (and dominant where their score is positive)
    chosen = {}
    for index, router in routers.items():
        router.register_forward_hook(lambda module, args, out, index=index: chosen.__setitem__(index, out[2].clone()))
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    assert set(chosen) == set(routers)
    engine = Engine.load(tmp_path, device="cpu", dtype="float32")
    routed = {}
    for index in routers:
        ffn = engine.model[f"ffn[{index}]"]
        original = ffn.route
        ffn.route = lambda w, h, original=original, index=index: routed.setdefault(index, original(w, h))
    torch.testing.assert_close(engine.logits(PROMPT), expected, rtol=1e-4, atol=1e-4)
    for index in routers:
        assert torch.equal(routed[index].experts, chosen[index]), f"layer {index} routes differently"
    if first_layer != last:
        first = routed[first_layer].experts
        assert torch.equal(first, first[:1].expand_as(first))  # all tied: the same experts for every token
    tied = routed[last].experts
    assert any(set(row.tolist()) < {0, 1, 3} for row in tied)  # two of the three tied experts chosen


# ---------------------------------------------------------------------------------------- cache
def test_frequency_with_recency_policy():
    policy = FrequencyRecency(half_life=4)
    for key in ["a", "a", "a", "b", "c"]:
        policy.touch(key)
    for key in "abc":
        policy.insert(key)
    assert policy.victim(protected=set()) == "b"  # used once, earlier than c
    assert policy.victim(protected={"c"}) == "a"  # c protected
    policy.insert("a")
    for _ in range(40):  # a long time later, "d" is used often: old frequency of "a" has decayed
        policy.touch("d")
    policy.insert("d")
    policy.touch("a")
    assert policy.victim(protected=set()) == "c"


def test_expert_cache_hits_misses_evictions(tiny_model_dir):
    _, model, host = loaded(tiny_model_dir, "qwen3_moe")
    copier = FakeCopier(host, 3)
    cache = ExpertCache(3, copier)
    got = [e for e, _ in cache.fetch("ffn[0]", [1, 2])]
    assert got == [1, 2] and (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (0, 2, 0)
    got = [e for e, _ in cache.fetch("ffn[0]", [5, 2])]
    assert got == [2, 5]  # cached first, while the miss is copied
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 3, 0)
    list(cache.fetch("ffn[0]", [2, 6]))  # full: evicts the least used (1 or 5), never 2
    assert cache.stats.evictions == 1 and ("ffn[0]", 2) in cache and ("ffn[0]", 6) in cache
    # The copy into a slot is issued before it is read, and a slot is only refilled after "done".
    fills = [entry for entry in copier.log if entry[0] == "fill"]
    assert len(fills) == cache.stats.misses
    # More experts than slots in one layer: each yielded slot is reused after its use.
    small = ExpertCache(1, FakeCopier(host, 1))
    assert [e for e, _ in small.fetch("ffn[0]", [0, 3, 4])] == [0, 3, 4]
    assert small.stats.evictions == 2 and small.stats.hit_rate == 0.0
    log = small.copier.log
    assert log.index(("done", 0)) < log.index(("fill", 0, "ffn[0]", 3))


def test_a_warmed_cache_starts_full_and_gives_way_to_used_experts():
    """At load the cache's slots are filled evenly over the cached layers (decode then starts at a
    full cache's hit rate); the warmed experts count as nothing and are the first evicted."""
    class Recording:  # the copier protocol, recording fills only
        def __init__(self):
            self.fills = []

        def fill(self, slot, name, expert):
            self.fills.append((name, expert))
            return 3

        ready = done = staticmethod(lambda slot: None)  # no stream to order
        view = staticmethod(lambda slot, name: None)

    copier = Recording()
    cache = ExpertCache(5, copier)
    names = ["ffn[0]", "ffn[1]"]
    assert cache.warm(names, 8) == 5
    assert copier.fills == [("ffn[0]", 0), ("ffn[1]", 0), ("ffn[0]", 1), ("ffn[1]", 1), ("ffn[0]", 2)]
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (0, 0, 0)
    assert cache.warm(names, 8) == 0  # full: nothing more
    got = [e for e, _ in cache.fetch("ffn[0]", [1, 3])]
    assert got == [1, 3] and (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 1, 1)
    list(cache.fetch("ffn[1]", [3, 4]))
    assert all(k in cache for k in [("ffn[0]", 1), ("ffn[0]", 3), ("ffn[1]", 3), ("ffn[1]", 4)])
    assert cache.stats.evictions == 3  # every eviction a warmed expert: the used ones stayed
    assert len(copier.fills) == 5 + cache.stats.misses


def test_prefetched_experts_are_hits_when_asked_for_and_never_evict_each_other(tiny_model_dir):
    _, model, host = loaded(tiny_model_dir, "qwen3_moe")
    assert model["ffn[0]"].num_experts >= 8
    copier = FakeCopier(host, 4)
    cache = ExpertCache(4, copier)
    list(cache.fetch("ffn[0]", [0, 1]))
    assert cache.prefetch("ffn[0]", [1, 2, 3, 3]) == 2  # 1 is cached already; 3 once
    assert (cache.stats.hits, cache.stats.misses, cache.stats.prefetched) == (0, 2, 2)  # no use counted
    got = [e for e, _ in cache.fetch("ffn[0]", [2, 5])]
    assert got == [2, 5] and cache.stats.hits == 1 and cache.stats.prefetch_used == 1
    # A guess larger than the cache copies what fits, and never makes room with its own experts.
    assert cache.prefetch("ffn[0]", [4, 6, 7, 0, 1, 3]) == 4
    assert sum(("ffn[0]", e) in cache for e in (4, 6, 7, 0, 1, 3)) == 4
    assert all(("ffn[0]", e) in cache for e in (4, 6, 7))  # the first guesses, none evicted by the later
    # A guessed expert evicted before its step asked for it is not counted as used later.
    list(cache.fetch("ffn[0]", [2, 5, 1, 3]))  # four experts the cache must hold at once: 4 goes
    assert ("ffn[0]", 4) not in cache
    used = cache.stats.prefetch_used
    list(cache.fetch("ffn[0]", [4]))
    assert cache.stats.prefetch_used == used  # 4 was guessed, then evicted: its fetch is a miss
    fills = [entry for entry in copier.log if entry[0] == "fill"]
    assert len(fills) == cache.stats.misses + cache.stats.prefetched


def test_a_gathered_layer_frees_its_slots_with_one_mark(tiny_model_dir):
    """The compute over a gathered layer's slots is one point in the stream: a copier that can
    mark several slots free at once is asked once, not once per slot."""
    _, model, host = loaded(tiny_model_dir, "qwen3_moe")

    class Batching(FakeCopier):
        def done_many(self, slots):
            self.log.append(("done_many", tuple(slots)))

    copier = Batching(host, 4)
    cache = ExpertCache(4, copier)
    slots = cache.gather("ffn[0]", [0, 1, 2])
    cache.release(slots.values())
    marks = [entry for entry in copier.log if entry[0].startswith("done")]
    assert marks == [("done_many", tuple(slots.values()))]


# ---------------------------------------------------------------------------------------- plan
def test_moe_placements_as_data(tiny_model_dir):
    _, model, _ = loaded(tiny_model_dir, "qwen3_moe")
    triples, layers = sublayer_triples(model), model.args.num_hidden_layers
    assert moe_layers(model) == [0]  # layer 1 is a dense mlp_only layer
    cpu_moe = named_placement("experts-cpu", triples, layers, moe_layers=moe_layers(model))
    stream = named_placement("experts-stream", triples, layers, moe_layers=moe_layers(model))
    assert cpu_moe["ffn[0]"] == EXPERTS_CPU and cpu_moe["ffn[1]"].home == "vram" and cpu_moe["embed"].home == "vram"
    assert stream["ffn[0]"] == EXPERTS_CACHED and stream["embed"].compute == "cpu"
    for p in (cpu_moe, stream):
        assert Placement.from_json(p.to_json()) == p
    host_experts = Placement("mix", tuple((n, EXPERTS_CPU if n == "ffn[0]" else w) for n, w in stream.where))
    tiered = TieredPlacement((1, 64), (stream, host_experts), (None, 2), expert_cache=123)
    assert TieredPlacement.from_json(tiered.to_json()) == tiered
    # Old JSON (three-element entries, no expert_cache) still reads, and stays the same.
    plain = named_placement("gpu", triples, layers)
    assert '"expert_cache"' not in TieredPlacement.single(plain).to_json()
    assert Placement.from_json(plain.to_json()) == plain
    with pytest.raises(InvalidInputError, match="experts"):
        Where("gpu", "experts")
    with pytest.raises(InvalidInputError, match="experts"):
        Where("gpu", "vram", "host")
    with pytest.raises(InvalidInputError, match="Mixture-of-Experts"):
        named_placement("experts-cpu", triples, layers)
    # VRAM: the routers of split layers, plus the cache when the placement caches experts.
    slot = expert_slot_bytes(model)
    plain_need = vram_need(model, cpu_moe, 1, 64, 16)
    cached_need = vram_need(model, stream, 1, 64, 16, expert_cache=4 * slot)
    routers = sum(main_piece_bytes(model, n) for n in cpu_moe.expert_names())
    assert routers <= plain_need.experts <= routers + 2 * 2**20  # one buffer, rounded to the allocator's 2 MiB
    assert cached_need.experts == plain_need.experts + 4 * slot
    assert tiered_vram_need(model, tiered, 1, 64, 16, expert_cache=4 * slot).experts == cached_need.experts


def test_executor_refuses_split_of_dense_layers(tiny_model_dir):
    _, model, host = loaded(tiny_model_dir, "qwen3_moe")
    where = tuple((s.name, EXPERTS_CPU if s.name == "ffn[1]" else Where("cpu", "host")) for s in model)
    with pytest.raises(InvalidInputError, match="only Mixture-of-Experts"):
        Executor(model, host, Placement("bad", where))


QWEN30 = shape_model("qwen3-30b-a3b")
GiB = 2**30


def plan_qwen30(budget, **profile):
    peaks = dict(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1500)
    return Planner(QWEN30, synthetic(**{**peaks, **profile}), budget, context=2048, tiers=Tiers((1, 512))).plan()


def test_planner_moe_experts_on_cpu_win_when_pcie_is_slow():
    result = plan_qwen30(8 * GiB, h2d_gbps=2, cpu_mem_gbps=150)
    decode = result.tiers[1]
    assert set(decode.candidates) == set(MOE_FAMILIES)
    assert decode.candidates["experts-cpu"] < decode.candidates["experts-stream"]
    assert not decode.placement.expert_names("cache") and not decode.placement.names(home="stream")[4:]
    assert result.need.total <= 8 * GiB


def test_planner_moe_streaming_wins_when_pcie_is_fast():
    result = plan_qwen30(8 * GiB, h2d_gbps=400, cpu_mem_gbps=20)
    decode = result.tiers[1]
    assert decode.candidates["experts-stream"] < decode.candidates["experts-cpu"]
    assert decode.placement.expert_names("cache")
    assert result.expert_cache >= 16 * expert_slot_bytes(QWEN30)
    assert result.tiered().expert_cache == result.expert_cache
    need = tiered_vram_need(QWEN30, result.tiered(), 1, 2048, 512, expert_cache=result.expert_cache)
    assert need.experts == result.need.experts and result.need.total <= 8 * GiB


QWEN15 = shape_model("qwen1.5-moe-a2.7b")  # a gated shared expert of 5632 beside 60 experts of 1408


def test_a_shared_expert_counts_in_the_main_piece_its_cost_and_its_matmuls():
    ffn = QWEN15["ffn[0]"]
    shared = 3 * 2048 * 5632 * 2 + 2048 * 2  # gate, up, down and the one-row gate, bf16
    assert ffn.main_bytes == 2048 * 2 + 60 * 2048 * 2 + shared
    assert main_piece_bytes(QWEN15, "ffn[0]") >= ffn.main_bytes
    assert (1, 2048, 2 * 5632) in ffn.main_matmuls(1) and (1, 5632, 2048) in ffn.main_matmuls(1)
    plain = QWEN30["ffn[0]"]
    assert plain.main_matmuls(1) == [(1, 2048, 128)] and plain.main_bytes == 2048 * 2 + 128 * 2048 * 2
    cost = ffn.cost(1, 1024)
    assert cost.weight_bytes == ffn.main_bytes + ffn.expected_experts_touched(1) * ffn.expert_bytes
    assert cost.flops >= 2 * (3 * 2048 * 5632 + 4 * 3 * 2048 * 1408)


def plan_qwen15(budget):
    peaks = dict(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1500)
    return Planner(QWEN15, synthetic(**peaks), budget, context=1024, tiers=Tiers((1, 512))).plan()


def test_planner_splits_at_the_experts_with_the_shared_experts_in_vram_where_they_fit():
    result = plan_qwen15(8 * GiB)
    split = result.tiers[1].placement.expert_names()
    assert split and result.need.experts >= sum(main_piece_bytes(QWEN15, n) for n in split)
    assert result.need.total <= 8 * GiB


def test_planner_splits_as_many_moe_layers_as_their_shared_experts_fit_and_runs_the_rest_whole():
    """1.55 GiB of main pieces (routers and shared experts) cannot all sit in 2 GiB beside the workspace
    and slots: the first layers split at their experts as far as theirs fit, the rest run whole; with
    no room for even one, none splits; below the workspace and slots, the budget is refused."""
    in_order = sorted((s.name for s in QWEN15 if s.kind == "ffn"), key=lambda n: QWEN15[n].layer)
    for budget, least, most in ((2 * GiB, 1, len(in_order) - 1), (800 * 2**20, 0, 0)):
        result = plan_qwen15(budget)
        split = result.tiers[1].placement.expert_names()
        assert least <= len(split) <= most, (budget, len(split))
        assert set(split) == set(in_order[:len(split)])
        for tier in result.tiers.values():
            assert set(tier.placement.expert_names()) <= set(split)
            unsplit = [w for n, w in tier.placement.where if n in in_order and n not in split]
            assert all(w.home in ("host", "stream", "vram") for w in unsplit)
        cache = result.expert_cache
        assert result.need.experts == (split_router_bytes(QWEN15, split) + cache if split else 0)
        assert result.need.total <= budget
        assert any("do not fit" in note and "shared expert" in note for note in result.notes)
    with pytest.raises(BudgetError, match=r"below the minimum of .*MoE layers on the CPU"):
        plan_qwen15(64 * 2**20)


def plan_qwen30_with_kernels(monkeypatch, run_ahead_on: bool, budget=8 * GiB, shares: bool = True, **profile):
    """plan_qwen30 where the GPU's kernels read host experts and the run-ahead worker is on or off
    (``shares``: the planner may give the CPU a share of them, VRAMSHARD_PLAN_ZERO_COPY_SHARE)."""
    from vramshard.plan import moe_variants
    from vramshard.runtime import run_ahead, zero_copy_experts

    monkeypatch.setattr(moe_variants, "PLANS_SHARES", shares)
    monkeypatch.setattr(zero_copy_experts, "available", lambda: True)
    monkeypatch.setattr(run_ahead, "available", lambda dense=False: run_ahead_on)
    return plan_qwen30(budget, **profile)


def test_planner_leaves_the_cpus_share_off_without_the_run_ahead_worker(monkeypatch):
    """On the host thread every CPU share beside the kernels made decode slower on the H200 machine
    (fourteenth and sixteenth GPU sessions: the host waits for every layer's router, and the GPU for
    the host), so without the run-ahead worker no tier gets one."""
    result = plan_qwen30_with_kernels(monkeypatch, False)
    assert all(p.zero_copy_cpu_share == 0.0 for p in result.tiers.values())
    assert result.tiered().zero_copy_cpu_shares == ()


def test_planner_puts_all_or_none_of_a_tokens_host_experts_on_the_cpu_unless_asked(monkeypatch):
    """Every split of a token's experts between the CPU and the kernels measured on a GPU, on the
    run-ahead worker too, decoded slower than all on the CPU (thirty-fourth and thirty-fifth GPU
    sessions): unless asked, the planner chooses between all of them on the CPU (share 1) and
    none, whichever it prices faster."""
    from vramshard.plan.estimator import Estimator

    top_k = QWEN30["ffn[0]"].top_k
    asked = plan_qwen30_with_kernels(monkeypatch, True, cpu_mem_gbps=80)
    assert 0 < asked.tiers[1].zero_copy_cpu_share < 1  # (where a split is priced fastest)
    for cpu_mem_gbps in (80, 5):
        result = plan_qwen30_with_kernels(monkeypatch, True, shares=False, cpu_mem_gbps=cpu_mem_gbps)
        decode = result.tiers[1]
        assert all(p.zero_copy_cpu_share in (0.0, 1.0) for p in result.tiers.values())
        profile = synthetic(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=cpu_mem_gbps,
                            gpu_mem_gbps=1500)

        def step_s(count: int) -> float:
            est = Estimator(QWEN30, profile, decode.threads, result.expert_hit_rate, zero_copy_cpu_share=count / top_k)
            return est.simulate(decode.placement, 1, 2048).seconds

        if decode.placement.expert_names("host"):
            chosen = top_k if decode.zero_copy_cpu_share == 1.0 else 0
            assert step_s(chosen) <= step_s(top_k - chosen)


def test_planner_gives_the_cpu_the_share_of_host_experts_it_prices_fastest(monkeypatch):
    """With the run-ahead worker the decode tier's host experts are shared: the CPU takes the
    whole count of each token's experts whose step the estimator prices fastest (each other count
    priced too), the plan's prediction is that step, and prompt tiers (beyond the kernels' rows)
    get none. A CPU whose memory reads slower takes fewer experts."""
    from vramshard.plan.estimator import Estimator
    from vramshard.runtime.zero_copy_experts import cpu_expert_count

    top_k = QWEN30["ffn[0]"].top_k
    counts = {}
    for cpu_mem_gbps in (80, 20):
        result = plan_qwen30_with_kernels(monkeypatch, True, cpu_mem_gbps=cpu_mem_gbps)
        decode, prompt = result.tiers[1], result.tiers[512]
        assert decode.placement.expert_names("host") and prompt.zero_copy_cpu_share == 0.0
        share = decode.zero_copy_cpu_share
        counts[cpu_mem_gbps] = count = cpu_expert_count(share, top_k)
        assert 0 < count < top_k and share == count / top_k
        assert result.tiered().zero_copy_cpu_shares == (share, 0.0)
        profile = synthetic(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=cpu_mem_gbps,
                            gpu_mem_gbps=1500)

        def step_s(n: int) -> float:
            est = Estimator(QWEN30, profile, decode.threads, result.expert_hit_rate, zero_copy_cpu_share=n / top_k)
            return est.simulate(decode.placement, 1, 2048).seconds

        assert decode.predicted_s == pytest.approx(step_s(count))
        assert all(step_s(count) <= step_s(n) * (1 + 1e-9) for n in range(top_k))
        assert step_s(count) < step_s(0) * 0.95
        assert any(f"computes {count} of each token's {top_k} host experts" in note for note in result.notes)
    assert counts[20] < counts[80]


def test_planner_gives_no_share_where_the_cpu_cannot_keep_up(monkeypatch):
    result = plan_qwen30_with_kernels(monkeypatch, True, cpu_mem_gbps=2)
    assert all(p.zero_copy_cpu_share == 0.0 for p in result.tiers.values())


def test_a_plans_share_reaches_the_executor_and_its_calibration(monkeypatch, tiny_model_dir):
    """The executor computes a step's CPU share from its plan's tier (its own option overrides it),
    and the engine's calibration prices the plan with that share."""
    from vramshard.plan.calibrate import step_seconds
    from vramshard.plan.estimator import Estimator

    path = tiny_model_dir("qwen3_moe")
    model = build_model(open_checkpoint(path).config)
    host = pack_model(list(model), load_weights(model, open_checkpoint(path)), pin=False)
    experts_cpu = named_placement("experts-cpu", sublayer_triples(model), model.args.num_hidden_layers,
                                  moe_layers=moe_layers(model))
    tiered = TieredPlacement((1, 4, 64), (experts_cpu,) * 3, (None,) * 3, zero_copy_cpu_shares=(0.5, 0.25, 0.0))
    executor = Executor(model, host, tiered, simulate_gpu=True)
    assert [executor.zero_copy_share(n) for n in (1, 2, 4, 5, 64)] == [0.5, 0.25, 0.25, 0.0, 0.0]
    executor.zero_copy_cpu_share = 0.75
    assert executor.zero_copy_share(1) == 0.75

    monkeypatch.setattr(zero_copy_experts, "available", lambda: True)
    monkeypatch.setattr(run_ahead, "available", lambda dense=False: True)
    profile = synthetic(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1500)
    plan = Planner(model, profile, None, context=256, tiers=Tiers((1, 64))).plan()
    plan.tiers[1].placement = experts_cpu
    for share in (0.0, 0.5):
        plan.tiers[1].zero_copy_cpu_share = share
        expected = Estimator(model, profile, plan.tiers[1].threads, plan.expert_hit_rate,
                             zero_copy_cpu_share=share).simulate(experts_cpu, 1, 256).seconds
        assert step_seconds(model, profile, plan, 1) == pytest.approx(expected)
    assert Estimator(model, profile, zero_copy_cpu_share=0.5).simulate(experts_cpu, 1, 256).seconds != \
        pytest.approx(Estimator(model, profile).simulate(experts_cpu, 1, 256).seconds)


def test_a_tiered_placements_shares_round_trip_and_bad_ones_are_refused():
    p = named_placement("experts-cpu", sublayer_triples(QWEN30), QWEN30.args.num_hidden_layers,
                        moe_layers=moe_layers(QWEN30))
    tiered = TieredPlacement((1, 512), (p, p), (None, 8), expert_cache=0, zero_copy_cpu_shares=(0.375, 0.0))
    again = TieredPlacement.from_json(tiered.to_json())
    assert again.zero_copy_cpu_shares == (0.375, 0.0) and again.zero_copy_cpu_share(1) == 0.375
    assert TieredPlacement.from_json(TieredPlacement((1,), (p,), (None,)).to_json()).zero_copy_cpu_shares == ()
    with pytest.raises(InvalidInputError, match="one share in \\[0, 1\\] per tier"):
        TieredPlacement((1, 512), (p, p), (None, 8), zero_copy_cpu_shares=(0.5,))
    with pytest.raises(InvalidInputError, match="one share in \\[0, 1\\] per tier"):
        TieredPlacement((1, 512), (p, p), (None, 8), zero_copy_cpu_shares=(1.5, 0.0))


def test_a_share_of_n_experts_in_k_gives_the_executor_n():
    """The planner's share n/k turns back into n experts in the executor, for every n and k."""
    from vramshard.runtime.zero_copy_experts import cpu_expert_count

    assert all(cpu_expert_count(n / k, k) == n for k in range(1, 17) for n in range(k + 1))


def test_estimator_counts_routed_fraction_and_hit_rate():
    from vramshard.plan.estimator import Estimator

    ffn = QWEN30["ffn[0]"]
    est = Estimator(QWEN30, synthetic(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50))
    miss = est.expert_miss_bytes(ffn, 1)
    assert miss == pytest.approx(8 * expert_slot_bytes(QWEN30))  # decode: 8 of 128 experts
    est.expert_hit_rate = 0.75
    assert est.expert_miss_bytes(ffn, 1) == pytest.approx(miss / 4)
    assert est.experts_s(ffn, "cpu", 1) < est.compute_s(ffn, "cpu", 1, 1024) + est.launch_s(ffn, "cpu", 1)


# ---------------------------------------------------------------------------------------- GPU
def executor_engine(path, model, host, placement, **kw):
    executor = Executor(model, host, placement, max_tokens=64, max_context=64, device="cuda", **kw)
    return Engine(model, executor, name="tiny", max_context=64)


@pytest.mark.parametrize("spec", ["experts-cpu", "experts-stream", "experts-stream-small", "experts-hybrid",
                                  "experts-prefetch", "stream", "gpu", "mixed"])
@pytest.mark.parametrize("arch", GPU_MOE_ARCHS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_moe_placements_match_cpu(arch, spec, tiny_model_dir):
    path = tiny_model_dir(arch)
    reference = Engine.load(path, device="cpu", dtype="float32")
    expected = trace_logits(reference)
    model = build_model(open_checkpoint(path).config)
    host = pack_model(list(model), load_weights(model, open_checkpoint(path)), pin=True)
    triples, layers, moe = sublayer_triples(model), model.args.num_hidden_layers, moe_layers(model)
    cache = None
    if spec == "mixed":  # layer 0 experts on the CPU, layer 1 cached, all else streamed/resident
        placement = Placement("mixed", tuple(
            (s.name, EXPERTS_CPU if s.name == "ffn[0]" else EXPERTS_CACHED if s.name == "ffn[1]"
             else Where("gpu", "stream") if s.kind == "attn" else Where("gpu", "vram")) for s in model))
        if 1 not in moe:
            placement = Placement("mixed", tuple((n, Where("gpu", "vram") if n == "ffn[1]" else w)
                                                 for n, w in placement.where))
    else:
        name = "experts-stream" if spec in ("experts-stream-small", "experts-hybrid", "experts-prefetch") else spec
        placement = named_placement(name, triples, layers, moe_layers=moe)
        if spec in ("experts-stream-small", "experts-hybrid"):
            cache = 2 * expert_slot_bytes(model)  # fewer slots than a prefill routes to: evicts
    options = {"expert_cpu_share": 0.5} if spec == "experts-hybrid" else \
        {"expert_prefetch": True} if spec == "experts-prefetch" else {}
    # The CPU's and the cache's own decode paths (the zero-copy kernels have their tests below).
    engine = executor_engine(path, model, host, placement, expert_cache=cache, experts_zero_copy=False, **options)
    got = trace_logits(engine)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    assert engine.generate([PROMPT], 8) == reference.generate([PROMPT], 8)
    report = engine.executor.report
    if spec == "experts-stream-small":
        assert engine.executor.expert_cache.stats.evictions > 0
        assert report.expert_hit_rate is not None and report.bytes_streamed > 0
    if spec == "experts-cpu":
        assert report.crossings >= 2 * len(moe)
    if spec == "experts-hybrid":  # decode steps computed some misses on the CPU, copied others in
        stats = engine.executor.expert_cache.stats
        assert stats.elsewhere > 0 and stats.bytes_copied > 0
    if spec == "experts-prefetch" and len(moe) > 1:  # decode steps guessed the next layer's experts
        stats = engine.executor.expert_cache.stats
        assert stats.prefetched > 0 and stats.prefetch_used > 0
    assert engine.executor.peak_vram() > 0


def host_expert_engine(tiny_model_dir, arch: str, spec: str, **options):
    """(engine, CPU float32 reference, MoE layers) of a tiny model whose experts are in host
    memory: every MoE layer's (``experts-cpu``), or layer 0's beside layer 1's cached (``mixed``)."""
    path = tiny_model_dir(arch)
    reference = Engine.load(path, device="cpu", dtype="float32")
    model = build_model(open_checkpoint(path).config)
    host = pack_model(list(model), load_weights(model, open_checkpoint(path)), pin=True)
    moe = moe_layers(model)
    if spec == "mixed":  # layer 0's experts on the CPU, layer 1's cached (where it is MoE)
        placement = Placement("mixed", tuple(
            (s.name, EXPERTS_CPU if s.name == "ffn[0]" else EXPERTS_CACHED if s.name == "ffn[1]" and 1 in moe
             else Where("gpu", "stream") if s.kind == "attn" else Where("gpu", "vram")) for s in model))
    else:
        placement = named_placement(spec, sublayer_triples(model), model.args.num_hidden_layers, moe_layers=moe)
    return executor_engine(path, model, host, placement, **options), reference, moe


def assert_same_as_reference(engine, reference) -> None:
    torch.testing.assert_close(trace_logits(engine), trace_logits(reference), rtol=1e-3, atol=1e-3)
    assert engine.generate([PROMPT], 8) == reference.generate([PROMPT], 8)


@pytest.mark.parametrize("ahead", [False, True], ids=["host-thread", "run-ahead"])
@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("arch", GPU_MOE_ARCHS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_moe_host_experts_shared_between_the_kernels_and_the_cpu_match_cpu(arch, share, ahead, tiny_model_dir,
                                                                                 monkeypatch):
    """zero_copy_cpu_share: a decode step's host experts split between the GPU's kernels (reading
    pinned memory) and the CPU, or all on the CPU (share 1): each token's first experts the CPU's,
    the rest the kernels'; the logits and greedy tokens are the CPU reference's, and both sides
    computed experts. With run-ahead the CPU's share is the worker's, the GPU waiting for it."""
    from vramshard.layers.moe import MoEFFN
    from vramshard.runtime import run_ahead, zero_copy_experts

    monkeypatch.setattr(zero_copy_experts, "ENABLED", True)
    monkeypatch.setattr(run_ahead, "ENABLED", ahead)
    on_kernels, on_cpu = [], []
    real_kernels, real_cpu = zero_copy_experts.routed_experts, MoEFFN.run_experts
    monkeypatch.setattr(zero_copy_experts, "routed_experts",
                        lambda stacked, h, routing, *rest: on_kernels.append(int((routing.experts >= 0).sum()))
                        or real_kernels(stacked, h, routing, *rest))
    monkeypatch.setattr(MoEFFN, "run_experts", lambda self, source, h, routing, only=None:
                        on_cpu.append((source, h.shape[0], routing.experts.shape[1]))
                        or real_cpu(self, source, h, routing, only))
    engine, reference, moe = host_expert_engine(tiny_model_dir, arch, "experts-cpu", zero_copy_cpu_share=share)
    assert_same_as_reference(engine, reference)
    hosts = list(engine.executor.host_experts.values())
    top_k = engine.model[f"ffn[{moe[0]}]"].top_k
    shares = {k for source, rows, k in on_cpu if rows <= zero_copy_experts.ROWS and any(source is s for s in hosts)}
    assert shares == {zero_copy_experts.cpu_expert_count(share, top_k)}, "the CPU computed no share, or another"
    if share < 1:
        assert [n for n in on_kernels if n > 0], "the kernels computed no share"
    else:
        assert not on_kernels
    worker = engine.executor._run_ahead
    assert (worker is not None and worker._submitted > 0) == ahead, "the CPU's share ran on the wrong thread"


@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("arch", GPU_MOE_ARCHS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_moe_a_plans_zero_copy_share_runs_on_the_worker_and_matches_cpu(arch, share, tiny_model_dir, monkeypatch):
    """A plan's share (TieredPlacement.zero_copy_cpu_shares, as the planner sets it, no executor
    option; 1: all of them, the planner's default choice besides none): decode steps give the CPU's
    worker that many of each token's experts, prompt steps
    (a tier without a share) none, and the logits and greedy tokens are the CPU reference's. The
    plan's worker team (TieredPlacement.worker_threads) is the one the decode steps' parts ran with."""
    from vramshard.layers.moe import MoEFFN

    monkeypatch.setattr(zero_copy_experts, "ENABLED", True)
    monkeypatch.setattr(run_ahead, "ENABLED", True)
    on_cpu = []
    real_cpu = MoEFFN.run_experts
    monkeypatch.setattr(MoEFFN, "run_experts", lambda self, source, h, routing, only=None:
                        on_cpu.append((source, h.shape[0], routing.experts.shape[1]))
                        or real_cpu(self, source, h, routing, only))
    steps_parts = []  # each step's account of the worker's parts (RunAhead.last_parts)
    real_take = run_ahead.RunAhead._take_parts
    monkeypatch.setattr(run_ahead.RunAhead, "_take_parts",
                        lambda self: (real_take(self), steps_parts.append(dict(self.last_parts))))
    path = tiny_model_dir(arch)
    reference = Engine.load(path, device="cpu", dtype="float32")
    model = build_model(open_checkpoint(path).config)
    host = pack_model(list(model), load_weights(model, open_checkpoint(path)), pin=True)
    moe = moe_layers(model)
    p = named_placement("experts-cpu", sublayer_triples(model), model.args.num_hidden_layers, moe_layers=moe)
    teams = []  # the OpenMP team of each part the worker ran
    real_run = run_ahead.RunAhead._run
    monkeypatch.setattr(run_ahead.RunAhead, "_run", lambda self, number, job, threads:
                        teams.append(threads) or real_run(self, number, job, threads))
    monkeypatch.setattr(run_ahead, "FORCED_TEAM", None)
    tiered = TieredPlacement((zero_copy_experts.ROWS, 64), (p, p), (None, None), zero_copy_cpu_shares=(share, 0.0),
                             worker_threads=(2, None))
    engine = executor_engine(path, model, host, tiered)
    assert_same_as_reference(engine, reference)
    # The decode steps' parts ran with the plan's team (where the host has the cores for it).
    assert run_ahead.worker_threads(torch.get_num_threads(), 2) in teams, teams
    # A decode step hands the worker one part a MoE layer; the expert pass's call is within their computing.
    assert any(parts["parts"] == len(moe) and parts["longest_s"] > 0 for parts in steps_parts), steps_parts
    assert all(parts["expert_kernel_s"] <= parts["longest_s"] * parts["parts"] + 1e-6 for parts in steps_parts)
    top_k = engine.model[f"ffn[{moe[0]}]"].top_k
    hosts = list(engine.executor.host_experts.values())
    mine = [(rows, k) for source, rows, k in on_cpu if any(source is s for s in hosts)]  # (not the reference's)
    assert {k for rows, k in mine if rows <= zero_copy_experts.ROWS} == {zero_copy_experts.cpu_expert_count(share, top_k)}, \
        "the CPU computed no share, or another"
    assert {k for rows, k in mine if rows > zero_copy_experts.ROWS} <= {top_k}, "a prompt step was shared"
    assert engine.executor._run_ahead is not None and engine.executor._run_ahead._submitted > 0


@pytest.mark.parametrize("spec", ["experts-cpu", "mixed"])
@pytest.mark.parametrize("arch", GPU_MOE_ARCHS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_moe_experts_on_the_run_ahead_worker_match_cpu(arch, spec, tiny_model_dir, monkeypatch):
    """VRAMSHARD_RUN_AHEAD: a MoE layer's experts on the CPU are computed by the run-ahead worker
    (hidden states and routing copied to the host, the GPU waiting for the result), alone and
    beside cached experts; the logits and greedy tokens are the CPU reference's."""
    from vramshard.runtime import run_ahead

    monkeypatch.setattr(run_ahead, "ENABLED", True)
    engine, reference, moe = host_expert_engine(tiny_model_dir, arch, spec)
    assert_same_as_reference(engine, reference)
    ahead = engine.executor._run_ahead
    on_cpu = len(moe) if spec == "experts-cpu" else 1
    assert ahead is not None and ahead._submitted >= on_cpu  # every host-expert layer went to the worker


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_moe_worker_runs_each_step_with_its_tuners_team_and_matches_cpu(tiny_model_dir, monkeypatch):
    """The run-ahead worker's team tuning (runtime/team_tuner.py): each step's CPU parts run with the
    team the tuner gave for that step, the tuner hears of each such step with the worker's time, and
    the logits and greedy tokens are the CPU reference's whatever the team."""
    from vramshard.layers import cpu_gemv
    from vramshard.runtime import team_tuner

    if cpu_gemv.library() is None:
        pytest.skip("no C kernels here: the worker's team is not tuned")
    monkeypatch.setattr(run_ahead, "ENABLED", True)
    monkeypatch.setattr(run_ahead, "FORCED_TEAM", None)
    monkeypatch.setattr(team_tuner, "ENABLED", True)
    monkeypatch.setattr(zero_copy_experts, "ENABLED", False)  # (decode steps' experts on the worker, not the GPU's kernels)
    given, heard = [], []
    largest = run_ahead.largest_team(torch.get_num_threads())

    def team(tuner, tokens, planned, largest):
        given.append(1 + len(given) % min(3, largest))
        return given[-1]

    monkeypatch.setattr(team_tuner.TeamTuner, "team", team)
    monkeypatch.setattr(team_tuner.TeamTuner, "observe",
                        lambda tuner, tokens, used, seconds: heard.append((given[-1], used, tokens, seconds)))
    engine, reference, _ = host_expert_engine(tiny_model_dir, GPU_MOE_ARCHS[0], "experts-cpu")
    assert_same_as_reference(engine, reference)
    assert len(heard) >= 8, "the tuner heard of too few steps"
    assert all(used == asked for asked, used, _, _ in heard), "a step's parts ran with another team"
    assert len({used for _, used, _, _ in heard}) == min(3, largest)
    assert all(tokens >= 1 and seconds > 0 for _, _, tokens, seconds in heard)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_moe_worker_leaves_the_planning_process_its_core(tiny_model_dir, monkeypatch):
    """While the planning process makes a plan (Executor.spare_a_core), the worker's team leaves a core
    beside the host thread's (one fewer than the largest team of the step's threads), the tuner hears
    nothing of those steps and puts no team on trial in them, and the tokens are the CPU reference's."""
    from vramshard.layers import cpu_gemv
    from vramshard.runtime import plan_process, team_tuner

    if cpu_gemv.library() is None:
        pytest.skip("no C kernels here: the worker's team is not tuned")
    monkeypatch.setattr(run_ahead, "ENABLED", True)
    monkeypatch.setattr(run_ahead, "FORCED_TEAM", None)
    monkeypatch.setattr(team_tuner, "ENABLED", True)
    monkeypatch.setattr(zero_copy_experts, "ENABLED", False)  # (decode steps' experts on the worker)
    monkeypatch.setattr(plan_process, "planning", lambda: True)
    heard, teams = [], []
    observe = team_tuner.TeamTuner.observe
    monkeypatch.setattr(team_tuner.TeamTuner, "observe", lambda tuner, tokens, used, seconds: heard.append(used))
    real_run = run_ahead.RunAhead._run
    monkeypatch.setattr(run_ahead.RunAhead, "_run", lambda self, number, job, threads:
                        teams.append(threads) or real_run(self, number, job, threads))
    engine, reference, _ = host_expert_engine(tiny_model_dir, GPU_MOE_ARCHS[0], "experts-cpu")
    trace_logits(engine)  # (unspared: no scheduler polls; the worker and its tuner are made)
    tuner = engine.executor._team_tuner
    team = tuner.team(1, None, run_ahead.largest_team(engine.executor.step_threads))
    for _ in range(2 * team_tuner.SAMPLES):  # one-token steps' team held long enough: a neighbour goes on trial
        observe(tuner, 1, team, 1.0)
    assert tuner.on_trial(1), "no neighbouring team to put on trial on this machine"
    # Spared from the checked steps' first: trace_logits runs steps without the scheduler, whose polls set it (the
    # poll's part is test_host_load's); generate's polls keep it (plan_process.planning() says a plan is being made).
    engine.executor.spare_a_core(True)
    teams.clear()  # (the load's kernel warm-up at the plan's teams)
    heard.clear()
    trials = engine.executor.team_trial_steps
    assert_same_as_reference(engine, reference)
    assert engine.executor.sparing_core and teams
    assert max(teams) <= max(1, run_ahead.largest_team(engine.executor.step_threads) - 1), teams
    assert heard == []
    assert engine.executor.team_trial_steps == trials


@pytest.mark.parametrize("spec", ["experts-cpu", "mixed", "experts-stream"])
@pytest.mark.parametrize("arch", GPU_MOE_ARCHS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_moe_host_experts_read_by_the_gpu_from_pinned_memory_match_cpu(arch, spec, tiny_model_dir, monkeypatch):
    """VRAMSHARD_EXPERTS_ZERO_COPY: at decode sizes a MoE layer's experts are read by the GPU's
    kernels, from pinned host memory or, where cached, from their VRAM cache slot (no host round
    trip): experts on the CPU, beside cached ones, and all cached (a cache of two steps' experts,
    filled by the prompt); the logits and greedy tokens are the CPU reference's."""
    from vramshard.runtime import zero_copy_experts

    monkeypatch.setattr(zero_copy_experts, "ENABLED", True)
    calls = []
    real = zero_copy_experts.routed_experts
    monkeypatch.setattr(zero_copy_experts, "routed_experts", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    engine, reference, moe = host_expert_engine(tiny_model_dir, arch, spec)
    assert_same_as_reference(engine, reference)
    read_by_kernels = 1 + (1 in moe) if spec == "mixed" else len(moe)  # host-expert and cached layers
    assert len(engine.executor._host_stacked) == read_by_kernels
    cached = spec == "experts-stream" or (spec == "mixed" and 1 in moe)  # (tiny Qwen3-MoE's layer 1 is dense)
    # decode steps went through the kernels; on cached layers a prompt may too (its missing
    # experts copied into the slots first), on host-only layers it may not
    assert calls and 1 in calls
    assert max(calls) <= (zero_copy_experts.CACHED_ROWS if cached else zero_copy_experts.ROWS)
    if cached:
        assert engine.executor._slot_tables  # cached layers read by slot table


def test_a_zero_copy_cpu_share_outside_0_to_1_is_refused_by_name(tiny_model_dir):
    path = tiny_model_dir("qwen3_moe")
    model = build_model(open_checkpoint(path).config)
    host = pack_model(list(model), load_weights(model, open_checkpoint(path)), pin=False)
    placement = named_placement("experts-cpu", sublayer_triples(model), model.args.num_hidden_layers,
                                moe_layers=moe_layers(model))
    with pytest.raises(ValueError, match="zero_copy_cpu_share must be a share between 0 and 1, got 1.5"):
        Executor(model, host, placement, simulate_gpu=True, zero_copy_cpu_share=1.5)


def test_the_cpus_expert_count_balances_both_sides():
    from vramshard.runtime.zero_copy_experts import cpu_expert_count

    assert cpu_expert_count(0.315, 8) == 2  # 2 on the CPU: 1.37 against 1.89; 3: 2.06 against 1.58
    assert cpu_expert_count(0.5, 8) == 4 and cpu_expert_count(0.0, 8) == 0 and cpu_expert_count(1.0, 8) == 8
    assert cpu_expert_count(0.3, 2) == 0  # 1 on the CPU would take 0.7, both on the GPU 0.6
    assert cpu_expert_count(0.5, 2) == 1 and cpu_expert_count(0.5, 1) == 0  # (a tie: the GPU's)


def test_moe_bench_predicts_each_cells_decode_from_the_executors_own_switches(tiny_model_dir):
    """benchmarks/moe_bench's predicted decode tok/s: the estimator's one-token step of the executor's
    plan, with its zero-copy switch and CPU share (so a cell's prediction and measurement match up)."""
    from benchmarks.moe_bench import predicted_decode_tok_s
    from vramshard.plan.estimator import Estimator

    _, model, host = loaded(tiny_model_dir, "qwen3_moe")
    placement = named_placement("experts-cpu", sublayer_triples(model), model.args.num_hidden_layers,
                                moe_layers=moe_layers(model))
    executor = Executor(model, host, placement, simulate_gpu=True, experts_zero_copy=False)
    profile = synthetic(cpu_gflops=500, gpu_gflops=100_000, h2d_gbps=25, cpu_mem_gbps=40)
    expected = 1 / Estimator(model, profile, zero_copy=False).simulate(placement, 1, 256).seconds
    assert predicted_decode_tok_s(model, profile, executor, {}, 256) == pytest.approx(expected)


def test_moe_bench_runs_the_cells_in_the_order_asked():
    """benchmarks/moe_bench --placements: the cells named, in that order (a cell's executor can leave
    the process in a state the next one meets), then the --shares cells not named."""
    from benchmarks.moe_bench import in_order

    cells = [(label, None, None, {}) for label in ("planned", "experts-stream", "experts-zero-copy",
                                                   "experts-zero-copy-cpu@0.5", "experts-zero-copy-cpu@0.375")]
    labels = lambda chosen: [cell[0] for cell in chosen]  # noqa: E731
    assert labels(in_order(cells, None)) == labels(cells)
    assert labels(in_order(cells, "experts-zero-copy-cpu@0.375,experts-zero-copy,planned")) == [
        "experts-zero-copy-cpu@0.375", "experts-zero-copy", "planned", "experts-zero-copy-cpu@0.5"]
    assert labels(in_order(cells, "experts-zero-copy,no-such-cell")) == [
        "experts-zero-copy", "experts-zero-copy-cpu@0.5", "experts-zero-copy-cpu@0.375"]


def test_moe_bench_bound_counts_the_main_pieces_of_moe_layers_neither_split_nor_resident():
    """A shared expert is read from outside VRAM each step where its layer runs whole from host memory
    or a slot; a split layer keeps it in VRAM with the router."""
    from types import SimpleNamespace

    from benchmarks.moe_bench import routed_bound

    bw = {"h2d": 50e9, "cpu_read": 80e9, "shared_total": 100e9}
    names = [s.name for s in QWEN15 if isinstance(s, MoEFFN)]
    split = SimpleNamespace(resident={}, split_weights=dict.fromkeys(names), expert_cache=None, wire_codec=False)
    whole = SimpleNamespace(resident={}, split_weights={}, expert_cache=None, wire_codec=False)
    extra = routed_bound(QWEN15, whole, bw)["other_nonresident_bytes"] - \
        routed_bound(QWEN15, split, bw)["other_nonresident_bytes"]
    assert extra == sum(QWEN15[n].main_bytes for n in names) > 24 * 60e6


def test_the_estimator_prices_a_shared_expert_with_the_router_on_the_gpu_and_in_the_cpus_layer():
    from vramshard.plan.estimator import Estimator

    profile = synthetic(cpu_gflops=1500, gpu_gflops=200_000, h2d_gbps=50, cpu_mem_gbps=80, gpu_mem_gbps=1500)
    est = Estimator(QWEN15, profile)
    ffn = QWEN15["ffn[0]"]
    shared = est._matmul(1, 2048, 2 * 5632, "cuda", False) + est._matmul(1, 5632, 2048, "cuda", False)
    assert est.router_s(ffn, 1) >= est._matmul(1, 2048, 60, "cuda", False) + shared
    # A whole MoE layer on the CPU reads its shared expert too (69 MB at 80 GB/s: over 0.8 ms).
    assert est.compute_s(ffn, "cpu", 1, 1024) - est.experts_s(ffn, "cpu", 1, launches=False) > 0.8e-3

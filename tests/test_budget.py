"""A VRAM budget that changes while the model runs: sources, re-planning, the executor's reconfigure,
KV caches moving between VRAM and host memory, out-of-memory recovery and the server's /v1/budget.

Without a GPU the engine runs with ``simulate_gpu``: plans, VRAM accounting and KV placement are as on
a GPU (from a synthetic GPU profile), the arithmetic runs on the CPU, so greedy tokens can be compared."""

import functools
import logging

import pytest
import torch

from vramshard import Engine
from vramshard.errors import BudgetError, InvalidInputError
from vramshard.plan.memory import workspace_bytes
from vramshard.plan.planner import Planner
from vramshard.plan.tiers import Tiers
from vramshard.profile.query import synthetic
from vramshard.runtime import budget as budgets
from vramshard.runtime.executor import Executor
from vramshard.runtime.kv_cache import KVCache

TIERS = Tiers((1, 4, 16))
KV_TOKENS = 512  # max_batch 4 x max_context 128
GiB = 2**30


@functools.lru_cache(maxsize=None)
def gpu_profile():
    """The synthetic GPU profile, built on first use: building it at import would import the
    ``vramshard.profile.synthetic`` submodule during collection, which shadows the package's
    ``synthetic`` function for test files collected later (test_profile.py). Its host issues stream fills for
    next to nothing: the budget points below are set around a plan that streams this tiny model's attention with
    its KV cache in VRAM at "part", which the H100's cost of issuing a fill (four 20 us fills a step against a
    step of 0.65 ms) would trade for pinning them with the cache on the host."""
    from vramshard.profile.query import Profile

    profile = synthetic(cpu_gflops=50, gpu_gflops=20_000, h2d_gbps=25, cpu_threads=2)
    return Profile.from_dict({**profile.to_dict(), "fill_issue": {"graph": 1e-9, "graph_round": 1e-9, "round": 1e-9}})


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def reference(model_dir):
    return Engine.load(model_dir, device="cpu")


@pytest.fixture(scope="module")
def sizes(reference):
    """Budgets that matter for this model: the planner's minimum, its KV cache, all weights."""
    probe = Planner(reference.model, gpu_profile(), None, context=KV_TOKENS, tiers=TIERS)
    minimum = workspace_bytes(reference.model, TIERS.largest, KV_TOKENS) + 2 * probe.slot_bytes
    return {"minimum": minimum, "kv": probe.kv_bytes(), "weights": reference.model.nbytes}


def budget_points(sizes):
    """Everything fits / part pinned (the KV cache fits in VRAM beside them; the planner chooses its side) / KV does
    not fit (host) / below the minimum (all CPU)."""
    m, kv, w = sizes["minimum"], sizes["kv"], sizes["weights"]
    return {"all": m + kv + 2 * w, "part": m + kv + w // 3, "kv_host": m + kv // 2, "cpu": m // 2}


def simulated(model_dir, vram):
    return Engine.load(model_dir, vram=vram, simulate_gpu=True, profile=gpu_profile(), tiers=TIERS, max_step_tokens=16,
                       max_context=128, max_batch=4)


def prompts(lengths=(5, 30, 12), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]


def run_with_changes(engine, batch, new_tokens, changes: dict):
    """Generate through a scheduler, calling set_vram(changes[step]) before those steps; checks the
    accounting after every step. Returns the outputs and the plans seen (kv_on_gpu, need, layers whose KV
    cache the placement keeps in VRAM)."""
    scheduler = engine.scheduler(max_seqs=4, max_context=64)
    requests = [scheduler.add(p, max_new_tokens=new_tokens) for p in batch]
    seen, step = [], 0
    while scheduler.has_work:
        if step in changes:
            engine.set_vram(changes[step])
        scheduler.step()
        engine.budget.background.wait(60)  # a full plan asked for is ready by the next boundary
        step += 1
        executor, budget = engine.executor, engine.budget_watcher.in_force
        assert budget is None or executor.need.total <= budget
        assert engine.plan.kv_on_gpu == bool(executor.kv_layers_on_gpu)
        where = {layer: scheduler.kv.device_of(layer).type for layer in scheduler.kv.layers}
        assert set(where.values()) == {"cpu"}  # simulated: the "GPU" is the CPU
        seen.append((engine.plan.kv_on_gpu, executor.need.total, frozenset(executor.kv_layers_on_gpu)))
    return [r.output_ids for r in requests], seen


# ---------------------------------------------------------------------------- parsing and sources
def test_parse_vram_accepts_sizes_auto_none_and_says_what_is_wrong():
    assert budgets.parse_vram("4GiB") == 4 * GiB
    assert budgets.parse_vram(1234) == 1234
    assert budgets.parse_vram(" Auto ") == budgets.AUTO
    assert budgets.parse_vram(None) is None and budgets.parse_vram("none") is None
    for bad in ("4 parsecs", "-4GiB", -1, True, float("nan"), [4], ""):
        with pytest.raises(InvalidInputError, match="size|budget"):
            budgets.parse_vram(bad)


def test_set_vram_rejects_bad_values(reference):
    with pytest.raises(InvalidInputError, match="4GiB"):
        reference.set_vram("lots")
    with pytest.raises(InvalidInputError):
        reference.set_vram(-5)
    if not torch.cuda.is_available():
        with pytest.raises(BudgetError, match="without one"):
            reference.set_vram("auto")


def test_watcher_counts_explicit_changes_and_rate_limits_auto():
    settable = budgets.SettableBudget(8 * GiB)
    watcher = budgets.BudgetWatcher(settable, 8 * GiB)
    assert watcher.poll() is None
    settable.set(4 * GiB)
    change = watcher.poll()
    assert change.budget == 4 * GiB and change.source == "set"
    watcher.accept(4 * GiB)
    assert watcher.poll() is None

    now = [0.0]
    free = [6 * GiB]
    auto = budgets.AutoBudget(margin=GiB, reader=lambda: (free[0], 16 * GiB), held=lambda: 2 * GiB,
                              min_interval_s=0.5)
    watcher = budgets.BudgetWatcher(auto, 7 * GiB, clock=lambda: now[0])
    assert watcher.poll() is None  # 6 + 2 - 1 = 7 GiB: unchanged
    free[0] = 2 * GiB
    assert watcher.poll() is None  # read less than 0.5 s ago: not read again
    now[0] = 1.0
    assert watcher.poll().budget == 3 * GiB
    watcher.accept(3 * GiB)
    free[0] = 2 * GiB + 100 * 2**20
    now[0] = 2.0
    assert watcher.poll() is None  # within the tolerance
    free[0] = 2 * GiB - 100 * 2**20
    now[0] = 3.0
    assert watcher.poll(need=3 * GiB).budget < 3 * GiB  # within the tolerance, but below what the plan needs


def test_ceiling_after_oom_holds_until_the_source_changes():
    settable = budgets.SettableBudget(8 * GiB)
    watcher = budgets.BudgetWatcher(settable, 8 * GiB)
    watcher.lower(5 * GiB)
    assert watcher.poll().budget == 5 * GiB
    watcher.accept(5 * GiB)
    assert watcher.poll() is None
    settable.set(6 * GiB)
    assert watcher.poll().budget == 6 * GiB
    assert budgets.budget_after_oom(10 * GiB, held=9 * GiB, free=0) == 9 * GiB - budgets.OOM_MARGIN_BYTES
    assert budgets.budget_after_oom(10 * GiB, held=10 * GiB, free=GiB) == 10 * GiB - budgets.OOM_MARGIN_BYTES
    assert budgets.budget_after_oom(800, held=800) == 700  # small plans: an eighth less


# ---------------------------------------------------------------------------- deciding (no GPU needed)
def test_planner_kv_location_can_be_forced(reference, sizes):
    budget = budget_points(sizes)["all"]
    host = Planner(reference.model, gpu_profile(), budget, context=KV_TOKENS, tiers=TIERS, kv_on_gpu=False).plan()
    assert not host.kv_on_gpu and host.need.kv == 0
    assert all(p.placement[f"attn[{i}]"].compute == "cpu" for p in host.tiers.values() for i in (0, 1))
    with pytest.raises(BudgetError, match="must stay in VRAM"):
        Planner(reference.model, gpu_profile(), sizes["minimum"] + sizes["kv"] // 2, context=KV_TOKENS, tiers=TIERS,
                kv_on_gpu=True).plan()


def test_adapt_plan_follows_the_budget_down_and_up(reference, sizes):
    # Priced without decode graphs, as the simulated engines below plan, whatever this machine has (priced with
    # them, on a machine with CUDA, the "kv_host" budget keeps the cache in VRAM: fifty-fourth GPU session).
    settings = budgets.PlanSettings(gpu_profile(), TIERS, KV_TOKENS, decode_graphs=False)
    points = budget_points(sizes)
    cache = budgets.PlanCache()
    current, steps = None, []
    for name in ("all", "part", "kv_host", "cpu", "part", "all"):
        adaptation = budgets.adapt_plan(reference.model, settings, current, points[name], cache=cache)
        assert adaptation.plan.need.total <= points[name]
        steps.append((name, adaptation))
        current = adaptation.plan
    by = dict((name, a) for name, a in steps[:4])
    assert by["all"].plan.kv_on_gpu and len(by["all"].plan.pinned) == len(list(reference.model))
    assert len(by["part"].plan.pinned) < len(by["all"].plan.pinned) and by["part"].unpin
    assert by["kv_host"].kv_to_host and not by["kv_host"].plan.kv_on_gpu
    assert by["cpu"].plan.need.total == 0 and not by["cpu"].plan.pinned
    assert steps[4][1].pin and steps[5][1].kv_to_gpu is False  # KV came back at "part" already
    assert steps[4][1].kv_to_gpu
    assert cache.hits == 2 and cache.misses == 4  # "part" and "all" planned once each
    # Live KV caches larger than the reservation cannot go to VRAM: forced to host.
    forced = budgets.adapt_plan(reference.model, settings, None, points["all"], live_kv_positions=KV_TOKENS + 1)
    assert not forced.plan.kv_on_gpu


# ---------------------------------------------------------------------------- running (simulated GPU)
def test_budget_changes_during_generation_keep_greedy_tokens(model_dir, reference, sizes):
    points = budget_points(sizes)
    batch = prompts()
    want = [reference.generate([p], 20)[0] for p in batch]
    engine = simulated(model_dir, points["all"])
    assert engine.plan.kv_on_gpu
    changes = {2: points["part"], 5: points["kv_host"], 8: points["cpu"], 10: points["kv_host"],
               12: points["all"], 13: points["part"], 15: None}
    outputs, seen = run_with_changes(engine, batch, 20, changes)
    assert outputs == want
    kv_sides = [kv for kv, *_ in seen]
    # KV went to host and came back: the budget grew before step 12, whose step still ran under
    # the placement in force while the full plan was made; it came into force at step 13's boundary.
    assert kv_sides[1] and not kv_sides[6] and not kv_sides[12] and kv_sides[13]
    assert seen[8][1] == 0  # below the minimum: nothing on the GPU
    assert len([e for e in engine.budget_events if e["why"] != "refine"]) == len(changes)
    for event in engine.budget_events:  # the release, part by part
        parts = event["release_parts_s"]
        assert {"wait", "kv", "drop", "empty"} <= set(parts) and sum(parts.values()) <= event["release_s"] + 1e-6
    assert engine.budget_state()["vram_budget"] is None


def test_the_kv_cache_split_by_layer_keeps_greedy_tokens(model_dir, reference, monkeypatch):
    """Where the whole KV cache does not fit beside the weights worth pinning, the planner may keep the KV
    caches of the attention layers it pins in VRAM beside them and the others' in host memory (their
    attention on the CPU): the engine keeps each layer's cache beside its attention and accounts for it
    within the budget, moves it layer by layer as the budget grows and shrinks, and the greedy tokens are
    the CPU reference's (VRAMSHARD_KV_SPLIT=on)."""
    from vramshard.plan import planner as planning

    monkeypatch.setattr(planning, "KV_SPLIT", True)  # (the plan process's planner too: it is made in this one)
    profile = synthetic(cpu_gflops=5, gpu_gflops=20_000, h2d_gbps=1, cpu_mem_gbps=1, cpu_threads=2)
    context = 32 * 256  # max_batch x max_context
    probe = Planner(reference.model, profile, None, context=context, tiers=TIERS)
    minimum = workspace_bytes(reference.model, TIERS.largest, context) + 2 * probe.slot_bytes
    split = minimum + probe.kv_bytes() * 3 // 4 + reference.model.nbytes // 2
    engine = Engine.load(model_dir, vram=split, simulate_gpu=True, profile=profile, tiers=TIERS, max_step_tokens=16,
                         max_context=256, max_batch=32)
    plan, executor = engine.plan, engine.executor
    pinned = {s.layer for s in reference.model.attention_layers if s.name in plan.pinned}
    assert plan.kv_layers_in_vram == len(pinned) == 1 and plan.kv_on_gpu, plan.notes
    assert executor.kv_layers_on_gpu == pinned
    assert plan.need.kv == executor.need.kv == probe.layer_kv_bytes() and executor.need.total <= split
    batch = prompts()
    want = [reference.generate([p], 16)[0] for p in batch]
    everything = minimum + probe.kv_bytes() + 2 * reference.model.nbytes
    outputs, seen = run_with_changes(engine, batch, 16, {4: everything, 9: split})
    assert outputs == want
    layers = [kv_layers for *_, kv_layers in seen]
    assert layers[0] == pinned and layers[7] == {0, 1} and layers[-1] == pinned, layers


def test_a_shrinking_budget_gets_a_quick_plan_then_the_full_one(model_dir, reference, sizes):
    """VRAM is released on a plan made without the per-sub-layer search; a background thread
    makes the full plan for the same budget, which the next step boundary puts in force; a
    growing budget is planned fully in the background while the placement in force goes on, and
    comes into force the same way."""
    import vramshard.budget_follower as follower
    from vramshard.runtime import plan_process

    points = budget_points(sizes)
    batch = prompts()
    want = [reference.generate([p], 12)[0] for p in batch]
    engine = simulated(model_dir, points["all"])
    made_there = plan_process.shared().plans
    scheduler = engine.scheduler(max_seqs=4, max_context=64)
    requests = [scheduler.add(p, max_new_tokens=12) for p in batch]
    step = 0
    while scheduler.has_work:
        if step in (2, 6):
            engine.set_vram(points["part"] if step == 2 else points["all"])
        scheduler.step()
        if step == 2:
            assert engine.budget.refine is not None  # the quick plan is in force, the full one coming
            engine.budget.background.wait(60)
        if step == 3:
            assert engine.budget.refine is None  # put in force at step 3's boundary
            part = budgets.plan_for_budget(reference.model, engine.budget.plan_settings(), points["part"])
            assert follower.same_placements(engine.plan, part)
        if step == 6:  # grown: nothing planned under the lock, the placement in force goes on
            assert engine.budget.refine is not None and follower.same_placements(engine.plan, part)
            engine.budget.background.wait(60)
        step += 1
    assert [r.output_ids for r in requests] == want
    shrink, grow = [e for e in engine.budget_events if e["why"] != "refine"]
    assert shrink["quick_plan"] and shrink["budget"] == points["part"] and not grow["quick_plan"]
    assert grow["deferred"] and grow["plan_s"] == 0 and grow["budget"] == points["all"]
    assert engine.budget_events[-1]["why"] == "refine"  # the full plan for the grown budget
    full = budgets.plan_for_budget(reference.model, engine.budget.plan_settings(), points["all"])
    assert follower.same_placements(engine.plan, full)
    if plan_process.ENABLED:  # both full plans were made in the planning process, not beside the steps
        assert plan_process.shared().plans >= made_there + 2


def test_background_planner_plans_the_latest_budget_asked_for():
    import threading

    from vramshard.budget_follower import BackgroundPlanner

    started, release, made = threading.Event(), threading.Event(), []

    def make(budget, kv_forced):
        started.set()
        release.wait(10)
        made.append(budget)

    planner = BackgroundPlanner(make)
    planner.want(3, None)
    started.wait(10)
    for budget in (2, 1):  # asked while 3 is being planned: only the latest is planned next
        planner.want(budget, None)
    release.set()
    planner.wait(10)
    assert made == [3, 1]
    planner.want(5, False)
    planner.wait(10)
    assert made == [3, 1, 5]


def test_unchanged_budget_run_equals_reference_and_generate_polls(model_dir, reference, sizes):
    points = budget_points(sizes)
    engine = simulated(model_dir, points["part"])
    batch = prompts((7, 19), seed=1)
    assert engine.generate(batch, 12) == reference.generate(batch, 12)
    engine.set_vram(points["kv_host"])
    tokens = []
    for token in engine.stream(batch[0], 12):  # a change between streamed tokens
        tokens.append(token)
        if len(tokens) == 3:
            engine.set_vram(points["all"])
    assert tokens == reference.generate([batch[0]], 12)[0]
    assert engine.budget_watcher.in_force == points["all"]  # in force: the growth is planned in the background
    engine.budget.background.wait(30)  # on a slow machine the stream can end before that plan is made
    assert engine.logits(batch[1]).shape[0] == len(batch[1])  # a step boundary puts the full plan in force
    assert engine.plan.kv_on_gpu


def test_out_of_memory_in_a_step_replans_smaller_and_retries(model_dir, reference, sizes, monkeypatch, caplog):
    engine = simulated(model_dir, budget_points(sizes)["all"])
    batch = prompts((9,), seed=2)
    want = reference.generate(batch, 10)
    ffn = engine.model["ffn[1]"]
    real = ffn.forward
    failures = [2]  # the next two runs of ffn[1] fail

    def flaky(*args, **kwargs):
        if failures[0]:
            failures[0] -= 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(ffn, "forward", flaky)
    need_before = engine.executor.need.total
    with caplog.at_level(logging.WARNING):
        assert engine.generate(batch, 10) == want
    assert engine.executor.need.total < need_before
    assert [e["why"] for e in engine.budget_events if e["why"] != "refine"] == ["out of memory", "out of memory"]
    assert any("re-planning" in r.message for r in caplog.records)

    failures[0] = 10**6  # never recovers: a clear BudgetError, not a crash
    with pytest.raises(BudgetError, match="ran out of memory"):
        engine.generate(batch, 4)


def test_executor_without_handler_turns_oom_into_budget_error(reference, monkeypatch):
    executor = Executor(reference.model, reference.executor.host, reference.executor.placement, max_context=64)
    monkeypatch.setattr(reference.model["head"], "forward",
                        lambda *a, **k: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("out of memory")))
    kv = executor.new_kv_cache(1, 16)
    from vramshard.layers.step import Step

    with pytest.raises(BudgetError, match="free VRAM or lower --vram"):
        executor.forward(torch.tensor([1, 2]), Step.single(0, 2, kv_lookup=kv))


def test_move_layers_keeps_tables_and_content():
    cache = KVCache([0, 1], slots=1, max_ctx=64, kv_heads=2, head_dim=4, dtype=torch.float32,
                    device_of=lambda layer: "cpu")
    cache.allocator.admit("a", 40)
    table = list(cache.allocator.grow("a", 40))
    cache(0).k.normal_()
    before = cache(0).k.clone()
    assert cache.move_layers([0, 1], "cpu") == 0  # already there: nothing copied
    assert torch.equal(cache(0).k, before) and cache.allocator.table("a") == table


def test_a_caches_tensors_of_some_layers_are_those_it_holds_now():
    cache = KVCache([0, 1], slots=1, max_ctx=64, kv_heads=2, head_dim=4, dtype=torch.float32,
                    device_of=lambda layer: "cpu")
    assert [t.data_ptr() for t in cache.tensors([1, 7])] == [cache(1).k.data_ptr(), cache(1).v.data_ptr()]
    assert cache.tensors([]) == []


# ---------------------------------------------------------------------------- the server
def test_server_budget_endpoint_auth_and_validation(tmp_path_factory):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from test_server import KEY, _post, start_server, stop_server

    from vramshard.demo_model import ensure_demo_model

    model_dir = ensure_demo_model(tmp_path_factory.mktemp("budget_cache"))
    process, url = start_server(model_dir, "--api-key", KEY, "--max-seqs", 2, "--max-context", 64)
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{url}/v1/budget").status_code == 401
        assert _post(url, "/v1/budget", {"vram": "1GiB"}, key=None).status_code == 401
        assert _post(url, "/v1/budget", {"vram": "1GiB"}, key="sk-wrong").status_code == 401
        for body in ({"vram": "lots"}, {"vram": -3}, {"vram": True}, {}, {"vram": 1.5}):
            response = _post(url, "/v1/budget", body)
            assert response.status_code == 400, (body, response.text)
            assert response.json()["error"]["message"]
        response = _post(url, "/v1/budget", {"vram": "1GiB"})
        assert response.status_code == 200 and response.json()["vram_budget"] == GiB
        state = httpx.get(f"{url}/v1/budget", headers=headers).json()
        assert state["vram_budget"] == GiB and state["adjustable"] and "vram_reserved" in state
        assert _post(url, "/v1/budget", {"vram": None}).json()["vram_budget"] is None
        done = _post(url, "/v1/completions", {"model": "demo", "prompt": "hi", "max_tokens": 3})
        assert done.status_code == 200
    finally:
        stop_server(process)


# ---------------------------------------------------------------------------- on the GPU machine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_move_layers_round_trip():
    cache = KVCache([0, 1], slots=2, max_ctx=32, kv_heads=2, head_dim=8, dtype=torch.float16,
                    device_of=lambda layer: "cuda")
    cache.allocator.admit(0, 20)
    table = list(cache.allocator.grow(0, 20))
    cache(1).v.normal_()
    before = cache(1).v.cpu()
    assert cache.move_layers([1], "cpu") == cache(1).nbytes
    assert cache.device_of(1).type == "cpu" and cache.device_of(0).type == "cuda"
    assert cache.move_layers([1], "cuda") == cache(1).nbytes
    assert torch.equal(cache(1).v.cpu(), before) and cache.allocator.table(0) == table


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_reconfigure_releases_vram_and_keeps_tokens(model_dir, reference, sizes):
    points = budget_points(sizes)
    engine = Engine.load(model_dir, vram=points["all"], device="cuda", profile=gpu_profile(), tiers=TIERS,
                         max_step_tokens=16, max_context=128, max_batch=4)
    batch = prompts()
    want = [engine.generate([p], 20)[0] for p in batch]  # the GPU's own greedy tokens, budget unchanged
    # The grown budget of step 12 comes into force with its full plan at the boundary after it (KV back in
    # VRAM); "part" follows once it has, wherever the planner keeps the KV cache there (with the decode graphs
    # priced, on the host: more of the weights pinned).
    changes = {2: points["part"], 5: points["kv_host"], 8: points["cpu"], 10: points["kv_host"],
               12: points["all"], 15: points["part"]}
    scheduler = engine.scheduler(max_seqs=4, max_context=64)
    requests = [scheduler.add(p, max_new_tokens=20) for p in batch]
    step = 0
    while scheduler.has_work:
        if step in changes:
            engine.set_vram(changes[step])
        scheduler.step()
        engine.budget.background.wait(60)  # a grown budget's full plan comes into force at the next boundary
        step += 1
        executor = engine.executor
        held = torch.cuda.memory_reserved(executor.gpu) - executor._vram_before
        assert executor.need.total <= engine.budget_watcher.in_force
        gpu_layers = {layer for layer in scheduler.kv.layers if scheduler.kv.device_of(layer).type == "cuda"}
        assert gpu_layers == executor.kv_layers_on_gpu
        if step == 9:  # all on the CPU: the VRAM is given back
            assert executor.need.total == 0 and held <= 64 * 2**20
    assert [r.output_ids for r in requests] == want
    events = [e for e in engine.budget_events if e["why"] != "refine"]
    assert len(events) == len(changes) and all(e["release_s"] < 5 for e in events)
    everything = list(engine.budget_events)  # KV may come back in a grown budget's full plan ("refine")
    assert any(e["kv_bytes_to_host"] for e in everything) and any(e["kv_bytes_to_gpu"] for e in everything)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cached_blocks_past_the_plan_go_back_to_the_card_after_a_step(model_dir, sizes):
    """Free blocks the caching allocator keeps beyond the plan (here 512 MiB freed just before the
    step; in practice buffers that grow with the context chunk after chunk) are given back when
    the step ends, so what the process reserves stays within the plan between steps."""
    engine = Engine.load(model_dir, vram=budget_points(sizes)["all"], device="cuda", profile=gpu_profile(),
                         tiers=TIERS, max_step_tokens=16, max_context=128, max_batch=4)
    executor = engine.executor
    junk = torch.empty(512 * 2**20, dtype=torch.uint8, device=executor.gpu)
    del junk  # cached by the allocator, not returned to the card
    assert torch.cuda.memory_reserved(executor.gpu) - executor._vram_before > executor.need.total + 256 * 2**20
    engine.generate([prompts()[0]], 2)
    held = torch.cuda.memory_reserved(executor.gpu) - executor._vram_before
    pools = executor.graphs.pool_bytes if executor.graphs is not None else 0
    assert held <= executor.need.total + pools + 64 * 2**20

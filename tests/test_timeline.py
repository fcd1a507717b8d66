"""Where loading an engine spends its time (runtime/timeline.py, Engine.load_seconds): each phase's
wall seconds, added up where a phase is met again, and an engine's phases covering its load."""

import time

import torch

from vramshard import Engine
from vramshard.runtime.timeline import Timeline

from test_split_ffn import _split_placement


def test_a_phase_met_again_adds_up_and_the_order_is_the_first_meeting():
    timeline = Timeline()
    with timeline.phase("b"):
        time.sleep(0.02)
    with timeline.phase("a"):
        pass
    with timeline.phase("b"):
        time.sleep(0.02)
    assert list(timeline.seconds) == ["b", "a"]
    assert timeline.seconds["b"] >= 0.04 and timeline.seconds["a"] < 0.02
    other = Timeline()
    with other.phase("c"):
        time.sleep(0.01)
    timeline.merge(other)
    assert list(timeline.seconds) == ["b", "a", "c"] and abs(timeline.total - sum(timeline.seconds.values())) < 1e-12
    assert timeline.describe().startswith(f"{timeline.total:.1f} s: b ")


def test_a_phase_that_raises_is_still_counted():
    timeline = Timeline()
    try:
        with timeline.phase("failing"):
            time.sleep(0.01)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert timeline.seconds["failing"] >= 0.01


def test_an_engines_load_seconds_cover_its_phases_and_its_wall_time(tiny_model_dir, monkeypatch):
    """A checkpoint loaded with a split placement on a simulated GPU: reading, planning, the host
    layout, the CPU parts and kernels and the (simulated) VRAM are each timed, together no more than
    the load; a slow kernel warm-up shows in its own phase."""
    from vramshard.runtime.executor import Executor

    path = tiny_model_dir("llama", torch.bfloat16)
    reference = Engine.load(path, device="cpu", dtype="float32")
    warm = Executor._warm_cpu_kernels
    monkeypatch.setattr(Executor, "_warm_cpu_kernels", lambda self, plans: (time.sleep(0.3), warm(self, plans)))
    start = time.perf_counter()
    engine = Engine.load(path, placement=_split_placement(reference.model, [3, 15]), simulate_gpu=True,
                         max_context=64)
    wall = time.perf_counter() - start
    seconds = engine.load_seconds
    assert list(seconds) == ["read weights", "plan", "host layout", "CPU parts", "CPU kernels", "VRAM"]
    assert all(s >= 0 for s in seconds.values()) and sum(seconds.values()) <= wall
    assert seconds["CPU kernels"] >= 0.3 and all(s < 0.3 for name, s in seconds.items() if name != "CPU kernels")
    assert "VRAM" not in reference.load_seconds and list(reference.load_seconds)[:1] == ["read weights"]

"""Row-major copies of the down projections the CPU computes from a splittable FFN
(runtime/cpu_down.py, VRAMSHARD_CPU_DOWN_COPY): the same values in the row-major layout, made once
per part, dropped with the plans that used them, within the host-memory allowance; and an engine
whose split FFNs' CPU parts read them computes the logits of the CPU placement."""

import logging

import pytest
import torch

from vramshard import Engine
from vramshard.runtime import cpu_down, host_allowance
from vramshard.plan.placement import TieredPlacement
from vramshard.runtime.host_weights import pack_sublayer

from placement_helpers import PROMPT, trace_logits
from test_split_ffn import LONG_PROMPT, _ffn, _split_placement


def split_views(dtype=torch.bfloat16):
    ffn, weights = _ffn(dtype)
    return ffn, pack_sublayer(ffn, weights, pin=False, splittable=True).views


def test_a_splittable_ffns_part_gets_its_down_row_major_once():
    ffn, views = split_views()
    part = ffn.pieces_of(views, 0, 5)
    assert cpu_down.transposed(part["down_proj"])
    copies = cpu_down.DownCopies("on")
    copied = copies.part("ffn[0]", 5, part)
    down = copied["down_proj"]
    assert down.is_contiguous() and not cpu_down.transposed(down) and torch.equal(down, part["down_proj"])
    assert all(copied[k] is part[k] for k in part if k != "down_proj")  # the rest stay views
    assert copies.part("ffn[0]", 5, part) is copied and copies.nbytes == down.nbytes  # made once
    whole = copies.part("ffn[0]", ffn.num_pieces, views)  # a whole FFN the CPU computes: a wider copy instead
    assert whole["down_proj"].is_contiguous() and torch.equal(whole["down_proj"], views["down_proj"])
    assert copies.nbytes == whole["down_proj"].nbytes
    again = copies.part("ffn[0]", 5, part)["down_proj"]  # the five pieces: the wider copy's leading columns
    assert again.data_ptr() == whole["down_proj"].data_ptr() and torch.equal(again, part["down_proj"])
    copies.keep({("ffn[0]", 5)})  # the plans in force no longer compute the whole FFN on the CPU
    assert copies.nbytes == 0
    assert torch.equal(copies.part("ffn[0]", 5, part)["down_proj"], part["down_proj"])
    assert copies.nbytes == down.nbytes
    copies.keep(set())
    assert copies.nbytes == 0 and not copies._parts


def test_an_ffn_gets_one_copy_its_widest_part_and_the_narrower_parts_read_it():
    """Plans that split one FFN differently by step size: one copy, as wide as the widest part, made
    whichever part asks first; the others read its leading columns."""
    ffn, views = split_views()
    copies = cpu_down.DownCopies("on", views_of=lambda name, pieces: ffn.pieces_of(views, 0, pieces))
    copies.keep({("ffn[0]", 3), ("ffn[0]", 9)})
    narrow = copies.part("ffn[0]", 3, ffn.pieces_of(views, 0, 3))["down_proj"]
    wide = copies.part("ffn[0]", 9, ffn.pieces_of(views, 0, 9))["down_proj"]
    assert torch.equal(narrow, ffn.pieces_of(views, 0, 3)["down_proj"])
    assert torch.equal(wide, ffn.pieces_of(views, 0, 9)["down_proj"]) and wide.is_contiguous()
    assert narrow.data_ptr() == wide.data_ptr() and copies.nbytes == wide.nbytes  # one copy
    copies.keep({("ffn[0]", 3), ("ffn[0]", 12)})  # a plan that wants more pieces on the CPU: made again, wider
    assert copies.nbytes == 0
    assert torch.equal(copies.part("ffn[0]", 3, ffn.pieces_of(views, 0, 3))["down_proj"],
                       ffn.pieces_of(views, 0, 3)["down_proj"])
    assert copies.nbytes == ffn.pieces_of(views, 0, 12)["down_proj"].nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_copy_holds_the_views_values_whatever_the_shape(dtype):
    """The row-major copy (the C library's transpose for half precision, torch's for float32) of parts
    of every width, over a storage row longer than a tile and not a multiple of one."""
    store = torch.randn(300, 77).to(dtype)  # [F, D]: down stored transposed
    for rows in (1, 7, 64, 65, 130, 300):
        view = store[:rows].t()
        copy = cpu_down.row_major_copy(view)
        assert copy.is_contiguous() and copy.dtype == dtype and torch.equal(copy, view)


def test_plain_layouts_and_off_leave_the_views_as_they_are():
    ffn, weights = _ffn(torch.bfloat16)
    plain = pack_sublayer(ffn, weights, pin=False, splittable=False).views
    assert not cpu_down.transposed(plain["down_proj"])
    assert cpu_down.DownCopies("on").part("ffn[0]", ffn.num_pieces, plain) is plain
    _, views = split_views()
    part = ffn.pieces_of(views, 0, 5)
    off = cpu_down.DownCopies("off")
    assert off.part("ffn[0]", 5, part) is part and off.nbytes == 0


def test_auto_copies_up_to_a_quarter_of_the_available_memory(monkeypatch, caplog):
    ffn, views = split_views()
    one = ffn.pieces_of(views, 0, 4)["down_proj"].nbytes
    monkeypatch.setattr(host_allowance, "available_host_bytes", lambda: int(4 * 2.5 * one))  # room for two parts
    copies = cpu_down.DownCopies("auto")
    with caplog.at_level(logging.INFO, logger="vramshard.runtime.host_allowance"):
        made = [copies.part(f"ffn[{i}]", 4, ffn.pieces_of(views, 0, 4)) for i in range(3)]
    assert [not cpu_down.transposed(p["down_proj"]) for p in made] == [True, True, False]
    assert copies.nbytes == 2 * one
    assert "the copies' " in caplog.text and "are full" in caplog.text
    copies.keep({("ffn[0]", 4)})
    assert copies.nbytes == one
    assert not cpu_down.transposed(copies.part("ffn[2]", 4, ffn.pieces_of(views, 0, 4))["down_proj"])  # room again
    monkeypatch.setattr(host_allowance, "available_host_bytes", lambda: None)  # unknown: no copies
    assert cpu_down.DownCopies("auto").part("ffn[0]", 4, ffn.pieces_of(views, 0, 4))["down_proj"].stride(0) == 1


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT])
def test_split_ffns_with_row_major_down_copies_match_the_cpu_placement(tiny_model_dir, monkeypatch, prompt):
    """A simulated GPU's split FFNs (CPU parts from the copies) against the CPU placement, one token
    and many; the executor made a copy for each split FFN's CPU part when it loaded."""
    path = tiny_model_dir("llama", torch.bfloat16)
    reference = Engine.load(path, device="cpu", dtype="float32")
    expected = trace_logits(reference, prompt=prompt)
    monkeypatch.setattr(cpu_down, "MODE", "on")
    # (one plan for every step size: its first tier is not one-token decoding, which reads the plain weights)
    split = Engine.load(path, placement=TieredPlacement.single(_split_placement(reference.model, [3, 15])),
                        simulate_gpu=True, max_context=64)
    parts = split.executor._down_copies
    assert {key for key in parts._parts} == {("ffn[0]", 3), ("ffn[1]", 15)}  # made at load, not in a step
    got = trace_logits(split, prompt=prompt)
    assert parts.nbytes > 0 and {key for key in parts._parts} == {("ffn[0]", 3), ("ffn[1]", 15)}
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05 * expected.abs().max().item())
    monkeypatch.setattr(cpu_down, "MODE", "off")
    plain = Engine.load(path, placement=_split_placement(reference.model, [3, 15]), simulate_gpu=True, max_context=64)
    assert plain.executor._down_copies.nbytes == 0
    torch.testing.assert_close(got, trace_logits(plain, prompt=prompt), rtol=0.05, atol=0.05 * expected.abs().max().item())


def test_the_decode_tiers_copies_are_made_when_the_plans_are_taken_one_per_ffn(tiny_model_dir, monkeypatch):
    """Plans that split the FFNs differently at 16 and 64 rows (not packed): when the executor takes
    them, each FFN gets one copy as wide as its widest part, and neither tier's first step makes one
    (on the H100 machine each tier's first step copied for 0.9-1.2 s, session 37); both tiers compute the
    CPU placement's logits."""
    from vramshard.runtime import cpu_packed

    path = tiny_model_dir("llama", torch.bfloat16)
    reference = Engine.load(path, device="cpu", dtype="float32")
    monkeypatch.setattr(cpu_down, "MODE", "on")
    monkeypatch.setattr(cpu_packed, "MODE", "off")
    model = reference.model
    plans = TieredPlacement((1, 16, 64), (_split_placement(model, [3, 15]), _split_placement(model, [3, 9]),
                                          _split_placement(model, [5, 4])), (None, None, None))
    split = Engine.load(path, placement=plans, simulate_gpu=True, max_context=128)
    copies = split.executor._down_copies
    widths = {name: pieces for name, (pieces, _) in copies._copies.items()}
    assert widths == {"ffn[0]": 5, "ffn[1]": 15}  # ffn[0]'s widest decode-sized part is tier 64's
    made = {name: copy.data_ptr() for name, (_, copy) in copies._copies.items()}
    held = copies.nbytes
    assert len(PROMPT) < 16 < len(PROMPT) + 30 <= 64
    for prompt in (PROMPT, PROMPT + PROMPT[:30]):  # a 16-row tier's step, then a 64-row one's
        expected = trace_logits(reference, prompt=prompt, forced=[])
        got = trace_logits(split, prompt=prompt, forced=[])
        torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05 * expected.abs().max().item())
    assert {name: copy.data_ptr() for name, (_, copy) in copies._copies.items()} == made and copies.nbytes == held
    assert {("ffn[0]", 3), ("ffn[0]", 5)} <= set(copies._parts)  # both of ffn[0]'s parts read its one copy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden,intermediate", [(48, 80), (130, 202)])
def test_the_split_layout_holds_the_checkpoints_values(dtype, hidden, intermediate):
    """The split layout stores down transposed ([F, D]; the C library's transpose for half precision on
    the CPU, torch's otherwise): every view holds the checkpoint's values, whole and by pieces."""
    ffn, weights = _ffn(dtype, hidden=hidden, intermediate=intermediate)
    views = pack_sublayer(ffn, {k: v.clone() for k, v in weights.items()}, pin=False, splittable=True).views
    assert cpu_down.transposed(views["down_proj"])
    for spec in ffn.weights:
        assert torch.equal(views[spec.key], weights[spec.source]), spec.key
    part = ffn.pieces_of(views, 0, 5)
    width = part["gate_proj"].shape[0]
    assert torch.equal(part["down_proj"], weights[next(s.source for s in ffn.weights if s.key == "down_proj")][:, :width])


def test_a_plans_down_copies_made_ahead_come_into_force_with_it(tiny_model_dir, monkeypatch):
    """Executor.prepare stages the down copies a plan not yet in force will read (its prompt chunks: parts not
    packed), off the steps; the switch puts them in force, and the steps after it make none. The copies of a
    plan staged but never put in force go when another is staged. The logits are the CPU placement's."""
    from vramshard.runtime import cpu_packed

    monkeypatch.setattr(cpu_packed, "MODE", "off")
    monkeypatch.setattr(cpu_down, "MODE", "on")
    made = []
    copy = cpu_down.row_major_copy
    monkeypatch.setattr(cpu_down, "row_major_copy", lambda down: made.append(down.shape) or copy(down))
    path = tiny_model_dir("llama")
    reference = Engine.load(path, device="cpu")
    expected = trace_logits(reference, prompt=LONG_PROMPT)

    def plans(first):
        return TieredPlacement.every_tier(_split_placement(reference.model, [first, 15]), (1, 64), (False, False))

    engine = Engine.load(path, placement=_split_placement(reference.model, [3, 15]), simulate_gpu=True,
                         max_context=128)
    executor, copies = engine.executor, engine.executor._down_copies
    executor.reconfigure(plans(3), None)
    torch.testing.assert_close(trace_logits(engine, prompt=LONG_PROMPT), expected, rtol=1e-5, atol=1e-5)
    assert {name: pieces for name, (pieces, _) in copies._copies.items()} == {"ffn[0]": 3, "ffn[1]": 15}
    made.clear()
    executor.prepare(plans(5))
    assert len(made) == 1 and set(copies._staged) == {"ffn[0]"} and copies.staged_nbytes > 0  # (ffn[1]'s serves)
    executor.reconfigure(plans(5), None)
    assert {name: pieces for name, (pieces, _) in copies._copies.items()} == {"ffn[0]": 5, "ffn[1]": 15}
    assert copies._staged == {} and copies.staged_nbytes == 0
    assert copies.nbytes == sum(c.nbytes for _, c in copies._copies.values())
    torch.testing.assert_close(trace_logits(engine, prompt=LONG_PROMPT), expected, rtol=1e-5, atol=1e-5)
    assert len(made) == 1  # no copy made in the steps
    executor.prepare(plans(7))
    executor.prepare(plans(9))  # (the plan of 7 never comes: its copy goes)
    assert {name: pieces for name, (pieces, _) in copies._staged.items()} == {"ffn[0]": 9} and len(made) == 3
    executor.reconfigure(plans(9), None)
    torch.testing.assert_close(trace_logits(engine, prompt=LONG_PROMPT), expected, rtol=1e-5, atol=1e-5)
    assert len(made) == 3 and copies._copies["ffn[0]"][0] == 9

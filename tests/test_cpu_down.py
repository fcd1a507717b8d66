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
    whole = copies.part("ffn[0]", ffn.num_pieces, views)  # a whole FFN the CPU computes
    assert whole["down_proj"].is_contiguous() and torch.equal(whole["down_proj"], views["down_proj"])
    copies.keep({("ffn[0]", 5)})  # the plans in force no longer compute the whole FFN on the CPU
    assert copies.nbytes == down.nbytes


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

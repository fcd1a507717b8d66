"""DroppedBuffers: whether the buffers a placement switch dropped are still held."""

import gc

import torch

from vramshard.runtime.dropped import DroppedBuffers


class Holder:
    pass


def test_nothing_is_held_once_the_last_references_go():
    buffer, holder = torch.empty(64, dtype=torch.uint8), Holder()
    dropped = DroppedBuffers()
    dropped.watch(buffer, None, holder)
    assert dropped.held() == 2
    del buffer, holder
    assert dropped.held() == 0


def test_a_tensor_over_the_same_storage_keeps_the_buffer_held():
    buffer = torch.empty(64, dtype=torch.uint8)
    alias = torch.empty(0, dtype=torch.uint8).set_(buffer.untyped_storage())  # (no ``_base``: not a view of it)
    dropped = DroppedBuffers()
    dropped.watch(buffer)
    del buffer
    assert dropped.held() == 1  # (the tensor object is gone, its storage is not)
    del alias
    assert dropped.held() == 0


def test_a_reference_cycle_holds_a_buffer_until_the_collector_runs():
    holder = Holder()
    holder.me = holder
    holder.buffer = torch.empty(64, dtype=torch.uint8)
    dropped = DroppedBuffers()
    dropped.watch(holder, holder.buffer)
    gc.disable()
    try:
        del holder
        assert dropped.held() == 2
        gc.collect()
        assert dropped.held() == 0
    finally:
        gc.enable()

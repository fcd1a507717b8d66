"""The runtime's process-wide CUDA streams (runtime/streams.py): one per (device, role), so that
executors made one after another do not each leave a cuBLAS workspace behind."""

import threading

import torch

from vramshard.runtime import streams


def test_one_stream_per_device_and_role_made_once_even_from_many_threads(monkeypatch):
    made = []

    class FakeStream:
        def __init__(self, device):
            made.append(device)

    monkeypatch.setattr(streams, "_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    got, start = [], threading.Barrier(8)

    def ask():
        start.wait()
        got.append(streams.process_stream(torch.device("cuda", 0), "compute"))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in got}) == 1 and made == [torch.device("cuda", 0)]
    copy = streams.process_stream(torch.device("cuda", 0), "copy")
    other = streams.process_stream(torch.device("cuda", 1), "compute")
    assert copy is not got[0] and other is not got[0]
    assert streams.process_stream(torch.device("cuda"), "compute") is other  # no index: the current device
    assert made == [torch.device("cuda", 0), torch.device("cuda", 0), torch.device("cuda", 1)]

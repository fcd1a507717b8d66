"""How much host memory the CPU's optional copies of weights may take (runtime/host_allowance.py): a
quarter of the available memory, fixed at the first copy; none where it is unknown; no cap where
lifted; the log says the cap once and when it is full, once."""

import logging

from vramshard.runtime import host_allowance
from vramshard.runtime.host_allowance import HostAllowance


def test_a_quarter_of_the_available_memory_fixed_at_the_first_question(monkeypatch, caplog):
    available = [4000]
    monkeypatch.setattr(host_allowance, "available_host_bytes", lambda: available[0])
    allowance = HostAllowance("test copies", "TEST=on")
    with caplog.at_level(logging.INFO, logger="vramshard.runtime.host_allowance"):
        assert allowance.room_for(0, 600) and allowance.bytes == 1000
        available[0] = 40  # memory taken since: the cap stays what it was at the first copy
        assert allowance.room_for(600, 400) and not allowance.room_for(600, 401)
        assert not allowance.room_for(900, 200)
    assert caplog.text.count("test copies: copies of up to") == 1
    assert caplog.text.count("are full") == 1 and "TEST=on lifts" in caplog.text


def test_unknown_memory_allows_no_copies_and_a_lifted_cap_allows_any(monkeypatch):
    monkeypatch.setattr(host_allowance, "available_host_bytes", lambda: None)
    assert not HostAllowance("test copies", "TEST=on").room_for(0, 1)
    assert HostAllowance("test copies", "TEST=on", limited=False).room_for(10**15, 10**15)


def test_copies_let_go_at_a_switch_are_freed_on_another_thread_and_the_packed_parts_keep_uses_it():
    """release_later drops the list's objects on a thread of its own (the caller, holding the steps, goes
    on); PackedParts.keep hands it the parts it drops, its byte count updated at once."""
    import threading

    from vramshard.runtime import cpu_packed
    from vramshard.runtime.host_allowance import release_later

    freed_on, done = [], threading.Event()

    class Copy:
        nbytes = 10

        def __del__(self):
            freed_on.append(threading.current_thread().name)
            done.set()

    release_later([Copy()])
    assert done.wait(5) and freed_on == ["vramshard-release"]
    release_later([])  # (nothing to let go: no thread)

    parts = cpu_packed.PackedParts("on", gpu=True)
    parts._parts, parts.nbytes = {("ffn[0]", 3): Copy(), ("ffn[1]", 3): Copy()}, 20
    freed_on.clear()
    done.clear()
    parts.keep({("ffn[1]", 3)})
    assert set(parts._parts) == {("ffn[1]", 3)} and parts.nbytes == 10
    assert done.wait(5) and freed_on == ["vramshard-release"]

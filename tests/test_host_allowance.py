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

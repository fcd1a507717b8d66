"""On/off switches from the environment (vramshard/env.py)."""

import logging

from vramshard.env import switch


def test_switches_read_on_and_off_words_and_keep_the_default_otherwise(monkeypatch, caplog):
    name = "VRAMSHARD_TEST_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert switch(name, default=True) and not switch(name, default=False)
    for word in ("on", "ON", "1", "true", "Yes"):
        monkeypatch.setenv(name, word)
        assert switch(name, default=False)
    for word in ("off", "0", "False", "no", " NO "):
        monkeypatch.setenv(name, word)
        assert not switch(name, default=True)
    monkeypatch.setenv(name, "maybe")
    with caplog.at_level(logging.WARNING):
        assert switch(name, default=True)
    assert name in caplog.text and "maybe" in caplog.text

"""On/off switches, three-way settings and numbers from the environment (vramshard/env.py)."""

import logging

from vramshard.env import choice, number, switch


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


def test_three_way_settings_take_their_words_on_off_spellings_and_keep_the_default_otherwise(monkeypatch, caplog):
    name, modes = "VRAMSHARD_TEST_CHOICE", ("auto", "on", "off")
    monkeypatch.delenv(name, raising=False)
    assert choice(name, modes, "auto") == "auto"
    for word, meant in (("AUTO", "auto"), (" on ", "on"), ("1", "on"), ("yes", "on"), ("false", "off"), ("0", "off")):
        monkeypatch.setenv(name, word)
        assert choice(name, modes, "auto") == meant, word
    monkeypatch.setenv(name, "fast")
    with caplog.at_level(logging.WARNING):
        assert choice(name, modes, "auto") == "auto"
    assert name in caplog.text and "fast" in caplog.text and "auto, on, off" in caplog.text
    monkeypatch.setenv(name, "1")  # on/off spellings only where the choices are on and off
    assert choice(name, ("mask", "bias"), "bias") == "bias"


def test_numbers_take_numbers_at_least_the_minimum_and_keep_the_default_otherwise(monkeypatch, caplog):
    name = "VRAMSHARD_TEST_NUMBER"
    monkeypatch.delenv(name, raising=False)
    assert number(name, 500.0) == 500.0
    for text, meant in (("0", 0.0), (" 250 ", 250.0), ("1e3", 1000.0)):
        monkeypatch.setenv(name, text)
        assert number(name, 500.0) == meant, text
    for text in ("fast", "-1", "nan"):
        monkeypatch.setenv(name, text)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert number(name, 500.0) == 500.0, text
        assert name in caplog.text and text in caplog.text


def test_the_kernel_and_the_profile_draw_the_c_kernels_row_line_from_one_variable():
    """layers/cpu_gemv.FFN_ROWS (the rows the C kernel computes) and profile/query.KERNEL_ROWS (the row
    class its fitted CPU factors stay within) both follow VRAMSHARD_CPU_GEMV_ROWS, read at import."""
    import os
    import subprocess
    import sys

    code = ("from vramshard.profile.query import KERNEL_ROWS; from vramshard.layers.cpu_gemv import FFN_ROWS; "
            "print(KERNEL_ROWS, FFN_ROWS)")
    for value, meant in (("2", "2 2"), ("", "4 4"), ("9", "4 4")):
        env = {**os.environ, "VRAMSHARD_CPU_GEMV_ROWS": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == meant.split(), (value, out.stdout, out.stderr)

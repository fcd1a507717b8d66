"""Checks shared by the tests of mechanisms switched on or off by an environment variable."""

import importlib


def assert_opt_in(monkeypatch, module, variable: str) -> None:
    """``module.ENABLED``, read from ``variable`` when the module is imported, is off (and so is
    ``module.available()``) unless the variable asks for it; the module is reloaded as it was after."""
    monkeypatch.delenv(variable, raising=False)
    try:
        assert not importlib.reload(module).ENABLED and not module.available()
        monkeypatch.setenv(variable, "on")
        assert importlib.reload(module).ENABLED
    finally:
        monkeypatch.undo()
        importlib.reload(module)


def assert_opt_out(monkeypatch, module, variable: str) -> None:
    """``module.ENABLED``, read from ``variable`` when the module is imported, is on unless the
    variable turns it off (and then so is ``module.available()``); the module is reloaded as it was after."""
    monkeypatch.delenv(variable, raising=False)
    try:
        assert importlib.reload(module).ENABLED
        monkeypatch.setenv(variable, "off")
        assert not importlib.reload(module).ENABLED and not module.available()
    finally:
        monkeypatch.undo()
        importlib.reload(module)

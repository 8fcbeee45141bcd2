"""dynascope.core.warn.warn: a probe's notice reaches the user under every warning filter, and no filter can
turn it into an exception (the probes call it inside optimizer.step() and on background threads)."""

from __future__ import annotations

import warnings

import pytest

from dynascope.core.warn import warn


def test_error_filter_prints_instead_of_raising(capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn("dynascope: the disk is full")  # would raise with warnings.warn
    assert "RuntimeWarning: dynascope: the disk is full" in capsys.readouterr().err


def test_other_filters_keep_their_effect(capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn("dynascope: recorded", UserWarning)
    assert [(w.category, str(w.message)) for w in seen] == [(UserWarning, "dynascope: recorded")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warn("dynascope: ignored")
    assert capsys.readouterr().err == ""


def test_a_raising_showwarning_hook_does_not_escape() -> None:
    def hook(*args: object, **kwargs: object) -> None:
        raise OSError("stderr is gone")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        warn("dynascope: nowhere to go")

"""error_text: an exception in one line, never its type with nothing after it."""

from __future__ import annotations

import asyncio

import pytest

from powerprof.errtext import error_text


def test_a_message_is_kept_as_it_is():
    assert error_text(ValueError("bad level 999 W")) == "ValueError: bad level 999 W"


@pytest.mark.parametrize("exc, words", [
    (TimeoutError(), "timed out"),
    (asyncio.TimeoutError(), "timed out"),  # what asyncio.wait_for and aiohttp's total timeout raise
    (ConnectionResetError(), "reset the connection"),
    (EOFError(), "closed the connection"),
    (KeyError(), "no message"),
])
def test_an_exception_without_a_message_says_what_its_type_means(exc, words):
    text = error_text(exc)
    assert text.startswith(type(exc).__name__ + ": ") and words in text
    assert text.split(": ", 1)[1].strip()


def test_an_empty_exception_names_its_cause():
    try:
        try:
            raise OSError(111, "Connection refused")
        except OSError as inner:
            raise TimeoutError() from inner
    except TimeoutError as e:
        text = error_text(e)
    assert "timed out" in text and "Connection refused" in text

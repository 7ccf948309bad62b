"""Hostile inputs on surfaces the other batteries leave (hostile4): what a user sees for each."""

from __future__ import annotations

import pytest

from powerprof.daemon.tagapi import check_name


@pytest.mark.parametrize("name, said", [
    ("b" * 5000, "'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb…' (5000 characters)"),
    ("=cmd|' /C calc'!A0", "\"=cmd|' /C calc'!A0\""),
    ("日本", "'日本'"),
    ("a\nb", "'a\\nb'"),
])
def test_a_refused_tag_name_is_quoted_short(name, said):
    # `powerprof tag start <5000 characters>` printed all 5000 back (and the daemon answered them in its 400).
    with pytest.raises(ValueError) as e:
        check_name(name)
    assert said in str(e.value) and len(str(e.value)) < 200, str(e.value)
    assert "must be 1-128 characters of letters, digits and _ . : @ / -" in str(e.value)

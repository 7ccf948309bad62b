"""Level parsing: what users type for --limits / --clocks / --gpus, and the one error they get when it's wrong."""

from __future__ import annotations

import pytest

from powerprof.control.levels import DeviceRange, LevelError, parse_clock_levels, parse_gpu_indexes, parse_power_levels


def dev(index=0, min_w=150, max_w=320, default_w=300, clocks=(510, 2790), name="Card"):
    return DeviceRange(index, f"GPU-{index}", name, min_w, max_w, default_w, default_w, default_w, *clocks)


ONE = [dev()]


def test_mixed_forms_resolve_to_watts():
    assert parse_power_levels("220,180W,50%,250.5w", ONE) == [220.0, 180.0, 150.0, 250.5]
    assert parse_power_levels(["300", 250, "87%"], ONE) == [300.0, 250.0, 261.0]  # 87% of 300 = 261


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("", "no power levels given"),
        (" , ", "no power levels given"),
        ("180,,220", "empty item"),
        ("abc", "'abc' is not a number"),
        ("220V", "'220V' is not a number"),
        ("nan", "'nan' is not a number"),
        ("-180", "'-180' is negative"),
        ("180,180W", "duplicates '180'"),
        ("180,60%", "'60%' (180 W) duplicates '180'"),
        ("400", "'400' is outside the allowed range 150-320 W"),
        ("0", "'0' is outside the allowed range"),
        ("200%", "'200% = 600 W' is outside the allowed range"),
    ],
)
def test_each_bad_power_input_is_one_error_with_range_and_default(spec, fragment):
    with pytest.raises(LevelError) as ei:
        parse_power_levels(spec, ONE)
    msg = str(ei.value)
    assert fragment in msg
    assert "150-320 W" in msg and "default 300 W" in msg
    assert "Nothing was changed" in msg


@pytest.mark.parametrize("spec, fragment", [
    ("220,220.4", "'220.4' (220.4 W) is 2 W or less from '220'"),
    ("220,221.999W", "'221.999W' (221.999 W) is 2 W or less from '220'"),
    ("220,73%", "'73%' (219 W) is 2 W or less from '220'"),
    # Exactly 2 W: a card held at 222 W where 220 was set reads 2 W off, which limit_moved does not flag (it flags
    # more than LIMIT_TOLERANCE_W off), so the two levels were accepted though no reading tells them apart.
    ("220,222", "'222' (222 W) is 2 W or less from '220'"),
    ("220,220.0004", "'220.0004' (220 W) duplicates '220'"),  # NVML takes whole milliwatts: the same limit
])
def test_levels_closer_than_the_limit_read_back_can_tell_apart_are_refused(spec, fragment):
    # `--limits 220,220.4` ran two levels no reading can tell apart (a limit is held to +-2 W: LIMIT_TOLERANCE_W),
    # and the sweep then filed one setting's figures under two limits as if it had measured a 0.4 W step.
    with pytest.raises(LevelError) as ei:
        parse_power_levels(spec, ONE)
    msg = str(ei.value)
    assert fragment in msg, msg
    assert "Nothing was changed" in msg


def test_levels_more_than_two_watts_apart_are_kept():
    assert parse_power_levels("220,222.001,224.5", ONE) == [220.0, 222.001, 224.5]


def test_the_least_gap_is_the_one_limit_moved_tells_apart():
    # A level that passes the gap check must be one a reading can tell from its neighbour: held at the neighbour's
    # limit, the card reads off by more than the tolerance limit_moved judges by; refused ones it does not flag.
    from powerprof.collectors.limitwatch import LIMIT_TOLERANCE_W, limit_moved
    from types import SimpleNamespace

    def flagged(set_w, read_w):  # a GPU reading: the limit the card holds, as set and as enforced
        return limit_moved([SimpleNamespace(index=0, power_limit_w=read_w, enforced_limit_w=read_w)], {0: (set_w, set_w)})

    for b in (220.0 + LIMIT_TOLERANCE_W, 220.0 + LIMIT_TOLERANCE_W + 0.001):
        try:
            parse_power_levels(f"220,{b}", ONE)
            accepted = True
        except LevelError:
            accepted = False
        assert accepted == (flagged(220.0, b) is not None), (b, accepted)


def test_all_problems_are_listed_at_once():
    with pytest.raises(LevelError) as ei:
        parse_power_levels("abc,-5,999,200,200", ONE)
    assert len(ei.value.problems) == 4


def test_several_gpus_take_levels_from_their_common_range():
    gpus = [dev(0, 150, 320, 300), dev(1, 100, 250, 250)]
    assert parse_power_levels("150,250", gpus) == [150.0, 250.0]
    with pytest.raises(LevelError, match="outside the allowed range 150-250 W"):
        parse_power_levels("300", gpus)
    # Percentages are ambiguous when the defaults differ: refuse rather than guess.
    with pytest.raises(LevelError, match="differ in the default limit"):
        parse_power_levels("80%", gpus)


def test_gpus_without_a_common_range_are_refused():
    with pytest.raises(LevelError, match="no single power limit fits"):
        parse_power_levels("200", [dev(0, 100, 150, 150), dev(1, 200, 300, 300)])


def test_clock_levels_mhz_and_percent_of_max():
    assert parse_clock_levels("1500,1200MHz,50%", ONE) == [1500, 1200, 1395]
    with pytest.raises(LevelError, match="'3000' is outside the allowed range 510-2790 MHz"):
        parse_clock_levels("3000", ONE)
    with pytest.raises(LevelError, match="'-1500' is negative"):
        parse_clock_levels("-1500", ONE)
    with pytest.raises(LevelError, match="does not report its supported SM clocks"):
        parse_clock_levels("1500", [dev(clocks=(None, None))])


def test_gpu_indexes():
    assert parse_gpu_indexes("0,1", 2) == [0, 1]
    assert parse_gpu_indexes(None, 3) == [0, 1, 2]
    assert parse_gpu_indexes("all", 2) == [0, 1]
    for spec, fragment in [("2", "GPU 2 does not exist"), ("0,0", "listed twice"), ("x", "not a GPU index"), ("", "no GPU given")]:
        with pytest.raises(LevelError, match=fragment) as ei:
            parse_gpu_indexes(spec, 2)
        assert "GPU 0-1" in str(ei.value)


H200 = dev(0, 200, 700, 700, (345, 1980), name="NVIDIA H200")
L4 = dev(1, 40, 72, 72, (210, 2040), name="NVIDIA L4")
A100 = dev(2, 100, 400, 400, (210, 1410), name="NVIDIA A100-SXM4-40GB")


@pytest.mark.parametrize("spec, devices", [("180", [H200, L4]), ("60%", [H200, L4]), ("60%", [H200, A100]),
                                           ("60", [A100, L4])])
def test_a_mixed_host_is_refused_with_one_kind_at_a_time_as_the_fix(spec, devices):
    # A 180 W level is invalid on an L4 (40-72 W); percentages mean other watts on each card. The error must say
    # how to go on: sweep each kind of GPU on its own, naming the indexes of each kind.
    with pytest.raises(LevelError) as ei:
        parse_power_levels(spec, devices)
    msg = str(ei.value)
    kinds = {}
    for d in devices:
        kinds.setdefault(d.name, []).append(str(d.index))
    assert "one kind of GPU at a time" in msg, msg
    for name, idx in kinds.items():
        assert f"--gpus {','.join(idx)} ({name})" in msg, msg


def test_watts_every_card_of_a_mixed_set_accepts_are_levels_for_all():
    # An H200 and an A100 behind one server share 200-400 W: one level in watts is one setting for both.
    assert parse_power_levels("250,300W", [H200, A100]) == [250.0, 300.0]


STEPPED = [DeviceRange(0, "GPU-0", "Card", 150, 320, 300, 300, 300, 510, 2790,
                       clock_supported_mhz=tuple(range(510, 2791, 15)))]


@pytest.mark.parametrize("spec, first, second, runs_at", [
    ("1500,1505", "'1505' (1505 MHz)", "'1500' (1500 MHz)", 1500),
    ("1505,1514MHz", "'1514MHz' (1514 MHz)", "'1505' (1505 MHz)", 1500),
    ("2780,2789", "'2789' (2789 MHz)", "'2780' (2780 MHz)", 2775),
    ("1470,53%", "'53%' (1479 MHz)", "'1470' (1470 MHz)", 1470),  # 53% of 2790 = 1478.7 -> 1479
])
def test_clock_levels_the_driver_locks_to_one_supported_clock_are_refused(spec, first, second, runs_at):
    # `--clocks 1500,1505` on a card with 15 MHz steps ran one clock twice and filed it under two levels: the driver
    # locks to a supported clock (the highest at or below the level, as the simulator's does).
    with pytest.raises(LevelError) as ei:
        parse_clock_levels(spec, STEPPED)
    msg = str(ei.value)
    assert f"{first} and {second} both run at {runs_at} MHz on GPU 0 (Card" in msg, msg
    assert "Nothing was changed" in msg


def test_clock_levels_on_different_supported_clocks_are_kept():
    # 2789 runs at 2775, a step under the top clock: another setting than 2790.
    assert parse_clock_levels("1500,1529,1530,2789,2790", STEPPED) == [1500, 1529, 1530, 2789, 2790]
    # Without the supported-clock list (a GPU that reports only its range), levels are taken as given.
    assert parse_clock_levels("1500,1505", ONE) == [1500, 1505]


def test_a_clock_range_whose_ends_share_a_supported_clock_is_still_a_range():
    # lock_sm_clock_mhz(lo, hi) checks each end alone: a range is not two levels.
    assert parse_clock_levels(["1500"], STEPPED) == [1500] and parse_clock_levels(["1505"], STEPPED) == [1505]


def test_many_levels_breaking_one_rule_say_the_rule_once_and_list_them_compactly():
    # `--limits $(seq -s, 100 1 400)` printed 29 KB: the whole list, then "'N' is outside the allowed range 150-320 W"
    # once per level, and the gap rule's long sentence once per level 1 W from another.
    spec = ",".join(str(w) for w in range(100, 401))
    with pytest.raises(LevelError) as ei:
        parse_power_levels(spec, ONE)
    msg = str(ei.value)
    assert len(msg) < 1500, (len(msg), msg)
    assert msg.count("outside the allowed range") == 1 and msg.count("no reading tells") == 1, msg
    assert "130 levels are outside the allowed range 150-320 W: '100', '101', '102', '103', … (125 more) …, '400'" in msg, msg
    assert "(301 levels)" in msg and "Nothing was changed" in msg, msg
    # One level breaking a rule is said as before.
    with pytest.raises(LevelError, match=r"'400' is outside the allowed range 150-320 W"):
        parse_power_levels("200,400", ONE)

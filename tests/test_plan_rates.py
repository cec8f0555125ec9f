"""One rate syntax, in bits per second, for every command: ``run --link`` and ``islands.link``
(:func:`lightning_islands.app.netns.parse_link`) and ``plan --link-bps``
(:func:`lightning_islands.app.plan.parse_rate`) read the same text as the same number, and both
refuse every unit that may mean bytes, giving the bit form to write instead.

Fast: parsing only, no link is made.
"""

from __future__ import annotations

import math

import pytest

from lightning_islands.app import netns, plan, rates
from lightning_islands.app.cli import main as cli_main

# (text, bits per second): the forms both parsers accept
SAME = [
    ("25gbit", 25e9), ("25G", 25e9), ("25g", 25e9), ("25e9", 25e9), ("2.5e10", 25e9), ("25 Gbit/s", 25e9),
    ("25GBIT", 25e9), ("200mbit", 200e6), ("200M", 200e6), ("12.5mbit", 12.5e6), ("100kbit", 1e5),
    ("100k", 1e5), ("1tbit", 1e12), ("1T", 1e12), ("8000", 8000), ("8000bit", 8000), (".5g", 5e8),
    ("1mibit", 2**20), ("1gibit", 2**30), (" 1 Gbit ", 1e9),
]

# (unit, its prefix): every unit that may mean bytes per second, in the cases people write them
BYTE_UNITS = [
    ("bps", ""), ("kbps", "k"), ("mbps", "m"), ("gbps", "g"), ("tbps", "t"),
    ("Bps", ""), ("KBps", "k"), ("MBps", "m"), ("GBps", "g"), ("TBps", "t"), ("Gbps", "g"), ("Mbps", "m"),
    ("kibps", "ki"), ("mibps", "mi"), ("gibps", "gi"), ("tibps", "ti"),
    ("B/s", ""), ("kB/s", "k"), ("MB/s", "m"), ("GB/s", "g"), ("TB/s", "t"), ("Gb/s", "g"),
    ("B", ""), ("MB", "m"), ("GB", "g"), ("Gb", "g"),
]


@pytest.mark.parametrize("text, bps", SAME)
def test_run_and_plan_read_a_rate_as_the_same_bits_per_second(text, bps):
    run = netns.parse_link(text).rate_bps
    assert netns.parse_link(f"{text},100ms").rate_bps == run
    planned = plan.parse_rate(text)
    by_option = plan.build_parser().parse_args(["--link-bps", text]).link_bps
    assert run == planned == by_option == rates.parse_rate(text) == pytest.approx(bps, rel=1e-12)


@pytest.mark.parametrize("unit, prefix", BYTE_UNITS)
def test_every_byte_unit_is_refused_by_run_and_plan_with_the_bit_form(unit, prefix):
    text = f"25{unit}"
    with pytest.raises(ValueError) as by_run:
        netns.parse_link(f"{text},100ms")
    with pytest.raises(plan.PlanError) as by_plan:
        plan.parse_rate(text)
    for err in (by_run, by_plan):
        message = str(err.value)
        assert repr(text) in message and "ambiguous" in message
        assert f"write 25{prefix}bit for 25 " in message and f" or 200{prefix}bit for 25 " in message
    assert "RATE[,RTT][,tuned]" in str(by_run.value)  # run's message also gives the link's form
    # the bit forms it suggests mean the same number to both (run refuses rates below 8kbit)
    for suggested in (f"25{prefix}bit", f"200{prefix}bit") if prefix else ():
        assert netns.parse_rate(suggested) == plan.parse_rate(suggested)


def test_the_ambiguity_message_names_both_readings():
    with pytest.raises(ValueError) as err:
        rates.parse_rate("25gbps")
    assert str(err.value) == ("rate '25gbps' is ambiguous (tc reads it as gigabytes per second, others as gigabits): "
                              "write 25gbit for 25 Gbit/s or 200gbit for 25 GB/s")
    with pytest.raises(ValueError, match=r"write 12\.5mbit for 12\.5 Mbit/s or 100mbit for 12\.5 MB/s"):
        rates.parse_rate("12.5MB/s")


@pytest.mark.parametrize("text", ["inf", "Infinity", "unlimited", "1e400"])
def test_only_plan_takes_an_unlimited_link(text):
    assert plan.parse_rate(text) == math.inf
    with pytest.raises(ValueError, match="unlimited"):
        netns.parse_link(text)


@pytest.mark.parametrize("text", ["fast", "", "25 bits", "-1g", "1e", "25x", "1..2g", "25gbit/h"])
def test_unreadable_rates_are_refused_by_both_with_examples(text):
    with pytest.raises(ValueError, match="cannot read the rate|empty") as by_run:
        netns.parse_link(text)
    with pytest.raises(plan.PlanError, match="cannot read the rate") as by_plan:
        plan.parse_rate(text)
    assert "25gbit" in str(by_plan.value) and "1gbit" in str(by_run.value)


def test_the_plan_command_refuses_a_byte_unit_naming_the_option(capsys):
    assert cli_main(["plan", "--step-seconds", "0.3", "--params", "1e6", "--link-bps", "25gbps"]) == 2
    err = capsys.readouterr().err
    assert "--link-bps" in err and "'25gbps' is ambiguous" in err and "write 25gbit" in err
    assert "Traceback" not in err

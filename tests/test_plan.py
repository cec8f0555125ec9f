"""The planner against closed forms, its monotonicity, its search, its CLI and its errors.

Fast: no training and no processes; every simulation takes milliseconds.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_islands.app.cli import main as cli_main
from lightning_islands.codecs import make_codec
from lightning_islands.plan import IslandSpec, LinkSpec, PlanInputs, simulate, with_link
from lightning_islands.plan.config import inputs_from_islands, prediction_for
from lightning_islands.plan.costs import (
    DECODE_PASSES,
    ENCODE_PASSES,
    MERGE_PASSES,
    OUTER_PASSES,
    PREP_PASSES,
    chunk_kinds,
    exchange_chunk_numel,
    fragment_cost,
)
from lightning_islands.plan.fragments import fragment_sizes
from lightning_islands.plan.hardware import step_seconds
from lightning_islands.plan.inputs import default_tcp_window
from lightning_islands.plan.schedule import round_steps
from lightning_islands.plan.search import min_link_bps

INF = math.inf
PLAN_DIR = Path(__file__).resolve().parents[1] / "lightning_islands" / "plan"


def free_island(devices: int = 1, step: float = 0.5) -> IslandSpec:
    """An island whose own work (gather, codec, scatter, outer step) costs nothing."""
    return IslandSpec(devices, step, intra_bytes_per_s=INF, leader_bytes_per_s=INF)


def plan(islands, numel=1_000_000, bps=INF, rtt=0.0, poll=0.0, **kw) -> PlanInputs:
    kw.setdefault("exchange_chunk_mib", 0)
    kw.setdefault("codec", "fp32")  # the closed forms below count fp32 payloads
    return PlanInputs(tuple(islands), numel=numel, link=LinkSpec(bps=bps, rtt_s=rtt, poll_s=poll,
                                                                 tcp_window_bytes=kw.pop("window", INF)), **kw)


# ---------------------------------------------------------------------------------------------- closed forms
def test_one_island_with_free_work_is_always_busy():
    for bps, rtt in ((1e3, 0.5), (INF, 0.0)):
        result = simulate(plan([free_island(4)], bps=bps, rtt=rtt, sync_every=10, codec="int4"))
        assert result.utilization == [1.0]
        assert result.bytes_per_round == 0 and result.peak_bps == 0


def test_one_island_pays_only_its_own_work_whatever_the_link():
    spec = IslandSpec(4, 0.5, intra_bytes_per_s=2e9, leader_bytes_per_s=1e9)
    m, h = 2_000_000, 10
    # gather and scatter (merged values; fp32 has no residual): 3/4 of the vector each way; the codec:
    # encode + own decode + one merge term; each rank: pseudo-gradient and outer step over its quarter
    moved = 4 * m * 3 / 4 / 2e9
    codec = (ENCODE_PASSES + MERGE_PASSES) * 4 * m / 1e9
    ranks = (PREP_PASSES + OUTER_PASSES) * 4 * m / 4 / 1e9
    expected = h * 0.5 / (h * 0.5 + 2 * moved + codec + ranks)
    for bps, rtt in ((1e3, 0.5), (INF, 0.0)):
        result = simulate(plan([spec], numel=m, bps=bps, rtt=rtt, sync_every=h, codec="fp32"))
        assert result.utilization[0] == pytest.approx(expected, rel=1e-12)


def test_infinite_bandwidth_leaves_the_fixed_costs():
    # two equal islands arriving together: the header takes 3 RTT (set, heartbeats, one check), the size
    # all-gather one ring step and the payload one more: 5 RTT per round, and the leaders' work
    rtt, h, s = 0.05, 20, 0.5
    result = simulate(plan([free_island(), free_island()], rtt=rtt, poll=0.01, sync_every=h))
    assert result.utilization == pytest.approx([h * s / (h * s + 5 * rtt)] * 2, rel=1e-12)
    spec = IslandSpec(1, s, intra_bytes_per_s=INF, leader_bytes_per_s=1e9)
    m, n = 1_000_000, 2
    work = (ENCODE_PASSES + (n - 1) * DECODE_PASSES + n * MERGE_PASSES + PREP_PASSES + OUTER_PASSES) * 4 * m / 1e9
    result = simulate(plan([spec, spec], numel=m, rtt=rtt, poll=0.01, sync_every=h))
    assert result.utilization == pytest.approx([h * s / (h * s + 5 * rtt + work)] * 2, rel=1e-12)


@pytest.mark.parametrize("codec", ["fp32", "int4", "topk:0.1+int2"])
@pytest.mark.parametrize("chunk_mib", [0, 1])
def test_no_overlap_utilization_is_compute_over_compute_plus_transfer(codec, chunk_mib):
    m, h, s, bps, lanes = 3_000_000, 25, 0.3, 200e6, 3
    c = make_codec(codec)
    chunk = exchange_chunk_numel(chunk_mib, c.alignment)
    padded = sum(n * (-(-c.nbytes(v) // lanes) * lanes) for v, n in chunk_kinds(m, chunk))
    transfer = padded * 8 / bps
    island = free_island(step=s)
    result = simulate(plan([island, island], numel=m, bps=bps, sync_every=h, codec=codec,
                           lanes=lanes, exchange_chunk_mib=chunk_mib))
    assert result.utilization == pytest.approx([h * s / (h * s + transfer)] * 2, rel=1e-9)
    assert result.bytes_per_round == padded
    assert result.mean_bps == pytest.approx(padded * 8 / (h * s + transfer), rel=1e-9)


def test_overlap_hides_what_fits_in_tau_steps_and_stalls_for_the_rest():
    m, h, s, bps = 4_000_000, 20, 0.1, 100e6
    transfer = make_codec("fp32").nbytes(m) * 8 / bps  # 1.28 s
    island = free_island(step=s)
    for tau, stall in ((5, transfer - 5 * s), (15, 0.0), (20, 0.0)):
        result = simulate(plan([island, island], numel=m, bps=bps, sync_every=h, overlap_steps=tau,
                               lanes=1))
        assert result.utilization[0] == pytest.approx(h * s / (h * s + stall), rel=1e-9), tau
        assert result.peak_bps == pytest.approx(transfer * bps / (tau * s), rel=1e-9)


def test_balance_none_makes_the_fast_island_wait_and_time_balancing_does_not():
    fast, slow = free_island(step=0.2), free_island(step=0.6)
    none = simulate(plan([fast, slow], sync_every=30))
    assert none.utilization == pytest.approx([0.2 / 0.6, 1.0])
    timed = simulate(plan([fast, slow], sync_every=30, balance="time"))
    assert timed.utilization == pytest.approx([1.0, 1.0])
    assert timed.islands[0].steps_per_round == pytest.approx(90)
    # the first round runs the plain H / F (no step times measured yet), later ones fit the budget,
    # at most 8 H / F
    steps = round_steps(plan([free_island(step=0.01), slow], sync_every=30, fragments=3, balance="time"), 3)
    assert steps == [[10, 10], [80, 10], [80, 10]]


def test_a_whole_run_pays_the_last_overlapped_exchange():
    m, h, s, bps = 4_000_000, 20, 0.1, 100e6
    transfer = make_codec("fp32").nbytes(m) * 8 / bps
    rounds = 4
    island = free_island(step=s)
    result = simulate(plan([island, island], numel=m, bps=bps, sync_every=h, overlap_steps=h, lanes=1,
                           rounds=rounds))
    assert not result.steady and result.rounds == rounds
    assert result.utilization[0] == pytest.approx(rounds * h * s / (rounds * h * s + transfer), rel=1e-9)


def test_the_tcp_window_caps_each_lane():
    link = LinkSpec(bps=25e9, rtt_s=0.1, tcp_window_bytes=2**21)
    assert link.rate_bps(2) == pytest.approx(2 * 2**21 * 8 / 0.1)
    assert link.rate_bps(1000) == 25e9
    slow = simulate(plan([free_island(), free_island()], bps=25e9, rtt=0.1, window=2**21, lanes=2, sync_every=10))
    fast = simulate(plan([free_island(), free_island()], bps=25e9, rtt=0.1, window=2**21, lanes=64, sync_every=10))
    assert slow.link_rate_bps < fast.link_rate_bps and slow.utilization[0] < fast.utilization[0]


def test_the_sliced_path_spreads_the_leaders_gather_and_its_codec_work():
    big = IslandSpec(72, 5.0, intra_bytes_per_s=50e9, leader_bytes_per_s=300e9)
    small = IslandSpec(8, 5.5, intra_bytes_per_s=50e9, leader_bytes_per_s=300e9)
    inputs = plan([big, small], numel=10**12, bps=INF, sync_every=32, codec="int4", balance="time",
                  exchange_chunk_mib=1024)
    leader, sliced = simulate(inputs), simulate(replace(inputs, exchange_path="sliced"))
    # the 72-device island's 8 owners each receive an eighth of the fragment (71/72 of it from the others)
    # for the gather and send it back twice (the merged values, the residual), in parallel at 50 GB/s
    all_to_all = 3 * 4 * 10**12 / 8 * 71 / 72 / 50e9
    assert all_to_all < sliced.islands[0].leader_s < all_to_all + leader.islands[0].leader_s / 50
    assert sliced.min_utilization > leader.min_utilization
    assert sliced.leader_bytes == 0 and leader.leader_bytes == 4 * exchange_chunk_numel(1024, 128)


# ---------------------------------------------------------------------------------------------- monotonicity
codecs = st.sampled_from(["fp32", "bf16", "int4", "int2", "topk:0.1+int2", "sign"])


@st.composite
def plans(draw):
    n = draw(st.integers(1, 3))
    islands = [IslandSpec(draw(st.integers(1, 8)), draw(st.floats(0.01, 2.0)),
                          intra_bytes_per_s=draw(st.sampled_from([1e8, 1e9, INF])),
                          leader_bytes_per_s=draw(st.sampled_from([1e8, 1e9, INF]))) for _ in range(n)]
    f = draw(st.sampled_from([1, 2, 4]))
    h = f * draw(st.integers(1, 12))
    return PlanInputs(
        tuple(islands), numel=draw(st.integers(1, 5_000_000)),
        link=LinkSpec(bps=1e9, rtt_s=draw(st.sampled_from([0.0, 0.001, 0.05])),
                      tcp_window_bytes=draw(st.sampled_from([2**20, 2**26, INF]))),
        sync_every=h, fragments=f, overlap_steps=draw(st.integers(0, h // f)), codec=draw(codecs),
        lanes=draw(st.integers(1, 4)), balance=draw(st.sampled_from(["none", "time"])),
        exchange_chunk_mib=draw(st.sampled_from([0, 1, 4])))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(), st.floats(1e4, 1e11), st.floats(1.0, 100.0))
def test_more_bandwidth_never_lowers_utilization(inputs, bps, factor):
    low = simulate(with_link(inputs, bps))
    high = simulate(with_link(inputs, bps * factor))
    for a, b in zip(low.utilization, high.utilization):
        assert b >= a - 1e-12


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(), st.sampled_from([(1, 2), (1, 4), (2, 4)]), st.floats(1e5, 1e11))
def test_more_fragments_never_raise_the_peak_bandwidth(inputs, pair, bps):
    few, many = pair
    h = inputs.sync_every * many  # a multiple of both fragment counts
    tau = min(inputs.overlap_steps, h // many)
    a = simulate(replace(with_link(inputs, bps), sync_every=h, fragments=few, overlap_steps=tau))
    b = simulate(replace(with_link(inputs, bps), sync_every=h, fragments=many, overlap_steps=tau))
    assert b.peak_bps <= a.peak_bps * (1 + 1e-9)


# ---------------------------------------------------------------------------------------------- search
def test_min_link_matches_the_closed_form_without_overlap():
    m, h, s, target = 3_000_000, 25, 0.3, 0.97
    island = free_island(step=s)
    inputs = plan([island, island], numel=m, bps=1e6, sync_every=h, codec="int4", lanes=1)
    need = min_link_bps(inputs, target, rel_tol=1e-6)
    transfer_bits = make_codec("int4").nbytes(m) * 8
    assert need.bps == pytest.approx(transfer_bits / (h * s * (1 / target - 1)), rel=1e-5)
    assert simulate(with_link(inputs, need.bps)).min_utilization >= target
    assert simulate(with_link(inputs, need.bps * 0.99)).min_utilization < target


def test_min_link_says_what_limits_a_plan_no_bandwidth_can_fix():
    inputs = plan([free_island(step=0.2), free_island(step=0.6)], sync_every=30)
    need = min_link_bps(inputs, 0.97)
    assert need.bps is None and "balance=time" in need.note
    windowed = plan([free_island(), free_island()], numel=10**9, rtt=0.1, window=2**21, sync_every=1000)
    need = min_link_bps(windowed, 0.97)
    assert need.bps is None and "TCP windows" in need.note
    chatty = plan([free_island(step=0.01), free_island(step=0.01)], rtt=0.1, sync_every=10)
    need = min_link_bps(chatty, 0.97)
    assert need.bps is None and "round trips" in need.note
    assert min_link_bps(plan([free_island()]), 0.97).bps == 0.0
    with pytest.raises(ValueError, match="target"):
        min_link_bps(inputs, 1.5)


# ---------------------------------------------------------------------------------------------- pieces
def test_fragment_layouts_split_blocks():
    blocks = [10, 20, 30, 40, 50, 60]
    assert fragment_sizes(blocks, 3, "strided") == (50, 70, 90)
    assert fragment_sizes(blocks, 3, "sequential") == (30, 70, 110)
    assert fragment_sizes(blocks, 4, "sequential", rest=6) == (32, 72, 51, 61)
    with pytest.raises(ValueError, match="fragment_layout"):
        fragment_sizes(blocks, 2, "random")
    with pytest.raises(ValueError, match="lower islands.fragments"):
        fragment_sizes(blocks, 7)


def test_payloads_are_the_codecs_own_sizes_per_chunk():
    inputs = plan([free_island(), free_island(), free_island()], numel=10_000_000, codec="int4",
                  exchange_chunk_mib=8, lanes=2)
    cost = fragment_cost(inputs, inputs.numel)
    c = make_codec("int4")
    assert [(k.numel, k.count) for k in cost.chunks] == [(2**21, 4), (10_000_000 - 4 * 2**21, 1)]
    for k in cost.chunks:
        assert k.payload_bytes == c.nbytes(k.numel)
        assert k.wire_bytes == 2 * (-(-k.payload_bytes // 2) * 2)  # to the two others, padded to the lanes


@pytest.mark.parametrize("n, partners", [(4, 1), (8, 1), (3, 2), (6, 3)])
def test_the_butterfly_receives_from_its_partners_only(n, partners):
    """Four islands all-gather three payloads per round over three ring steps; the butterfly swaps
    one with one partner in one step (a count that is not a power of two: up to three partners)."""
    ring = plan([free_island()] * n, numel=4_000_000, bps=1e9, rtt=0.05, codec="int4")
    pairs = replace(ring, topology="butterfly")
    a, b = fragment_cost(ring, ring.numel), fragment_cost(pairs, pairs.numel)
    assert pairs.peers == partners
    assert b.wire_bytes * (n - 1) == a.wire_bytes * partners
    assert b.sizes_s == pytest.approx(0.05) and a.sizes_s == pytest.approx((n - 1) * 0.05)
    assert simulate(pairs).islands[0].utilization > simulate(ring).islands[0].utilization
    assert simulate(pairs).bytes_per_round * (n - 1) == pytest.approx(simulate(ring).bytes_per_round * partners)


def test_with_max_staleness_the_fast_islands_go_on_after_the_grace_window():
    """Islands of 1, 1 and 3 s per step, H=10, grace 2 s, free work and link. Round 0: the fast two
    arrive at 10 s and go on at 12; the slow one arrives at 30, late. Round 1 expects only the two
    (the members of round 0) and goes on when they arrive at 22; the slow one asks to join at 30 and
    round 2 takes it in without inner steps when the fast two arrive at 32. Every three rounds take
    32 s: 30 s of compute for each island; the slow one misses two rounds of three."""
    islands = [free_island(step=1.0), free_island(step=1.0), free_island(step=3.0)]
    barrier = simulate(plan(islands, sync_every=10, rounds=9))
    stale = simulate(plan(islands, sync_every=10, rounds=9, max_staleness=1, grace_s=2.0))
    assert barrier.utilization == pytest.approx([1 / 3, 1 / 3, 1.0])
    assert stale.utilization == pytest.approx([90 / 96] * 3)
    assert [i.late_fraction for i in stale.islands] == pytest.approx([0, 0, 6 / 9])
    assert [i.longest_absence for i in stale.islands] == [0, 0, 2]
    assert [i.late_fraction for i in barrier.islands] == [0, 0, 0]
    assert stale.islands[2].steps_per_round == pytest.approx(30 / 9)  # 10 steps in one round of three
    # no majority to go on with (two islands), or fewer than min_islands: the barrier again
    two = simulate(plan(islands[1:], sync_every=10, rounds=9, max_staleness=1, grace_s=2.0))
    assert two.utilization == pytest.approx([1 / 3, 1.0])
    held = simulate(plan(islands, sync_every=10, rounds=9, max_staleness=1, grace_s=2.0, min_islands=3))
    assert held.utilization == pytest.approx(barrier.utilization)
    # staleness_wait_s replaces the grace window here: 0.5 s, every three rounds 30.5 s
    short = simulate(plan(islands, sync_every=10, rounds=9, max_staleness=1, grace_s=100.0, staleness_wait_s=0.5))
    assert short.utilization[0] == pytest.approx(90 / 91.5)


def test_a_late_island_receives_the_global_state_in_the_round_it_joins():
    """The state (anchors and momentum, 8 bytes a value) crosses the link once per catch-up: 3 of the
    9 rounds above take it, each 8 x numel bytes over the link's rate longer for everyone; the 6
    rounds without the slow island cost what a round of two islands costs."""
    islands = [free_island(step=1.0), free_island(step=1.0), free_island(step=3.0)]
    numel, bps = 1_000_000, 1e9
    free = simulate(plan(islands, numel=numel, sync_every=10, rounds=9, max_staleness=1, grace_s=2.0))
    inputs = plan(islands, numel=numel, bps=bps, sync_every=10, rounds=9, max_staleness=1, grace_s=2.0,
                  codec="topk:0.000001")
    paid = simulate(inputs)
    pair = fragment_cost(replace(inputs, islands=tuple(islands[:2])), numel).link_s
    payloads = 3 * fragment_cost(inputs, numel).link_s + 6 * pair  # the rounds' own transfers (one value each)
    longer = 9 * (paid.islands[0].round_s - free.islands[0].round_s)
    assert longer == pytest.approx(3 * 8 * numel * 8 / bps + payloads, rel=1e-9)


def test_step_time_from_flops_and_the_default_tcp_window(tmp_path):
    assert step_seconds(50e9, 1e6, 1e18) == pytest.approx(0.3)
    (tmp_path / "tcp_rmem").write_text("4096 131072 33554432\n")
    (tmp_path / "tcp_wmem").write_text("4096 16384 4194304\n")
    assert default_tcp_window(tmp_path) == 2**21
    assert default_tcp_window(tmp_path / "missing") == 2**21


@pytest.mark.parametrize("change, message", [
    (dict(sync_every=30, fragments=4), "multiple of islands.fragments"),
    (dict(sync_every=32, fragments=4, overlap_steps=9), "overlap_steps"),
    (dict(codec="int3"), "islands.codec"),
    (dict(balance="fast"), "balance"),
    (dict(numel=0), "--params"),
    (dict(max_staleness=1, overlap_steps=1), "max_staleness"),
    (dict(grace_s=0.0), "grace_s"),
])
def test_bad_inputs_name_the_setting_and_the_fix(change, message):
    base = dict(islands=(free_island(),), numel=1000, link=LinkSpec(bps=1e9))
    with pytest.raises(ValueError, match=message):
        PlanInputs(**{**base, **change})
    with pytest.raises(ValueError, match="step_seconds"):
        IslandSpec(1, 0.0)
    with pytest.raises(ValueError, match="link-bps"):
        LinkSpec(bps=-1)


def test_prediction_for_reads_the_islands_config():
    islands = {"sync_every": 24, "fragments": 4, "overlap_steps": 2, "codec": "int4", "lanes": 2,
               "balance": "time", "exchange_chunk_mib": 1024, "members": [{"devices": 2}, {"devices": 1}]}
    pred = prediction_for(islands, numel=3_445_888, step_seconds=[0.3, 0.5], link_bps=200e6, rounds=8)
    assert len(pred.utilization) == 2 and pred.rounds == 8 and not pred.steady
    inputs = inputs_from_islands(islands, numel=3_445_888, step_seconds=0.3, link=LinkSpec(bps=1e9),
                                 block_sizes=[800_000] * 4)
    assert inputs.fragment_sizes == (861_472,) * 4
    with pytest.raises(ValueError, match="one per island"):
        prediction_for(islands, numel=10, step_seconds=[0.1, 0.2, 0.3], link_bps=1e9)
    assert inputs.exchange_path == "leader"
    each_rank, link = {**islands, "exchange": "sliced", "overlap_steps": 0}, LinkSpec(bps=1e9)
    sliced = inputs_from_islands(each_rank, numel=1000, step_seconds=0.3, link=link)
    assert sliced.exchange_path == "sliced"  # the config's islands.exchange, unless --path says otherwise
    forced = inputs_from_islands(each_rank, numel=1000, step_seconds=0.3, link=link, exchange_path="leader")
    assert forced.exchange_path == "leader"


def test_the_islands_steps_per_round_reaches_the_plan_as_it_reaches_training():
    islands = {"members": [{"devices": 1}, {"devices": 1, "steps_per_round": 5}], "sync_every": 20,
               "steps_per_round": 10}
    inputs = inputs_from_islands(islands, numel=1000, step_seconds=0.1, link=LinkSpec(bps=1e9))
    assert [spec.steps_per_round for spec in inputs.islands] == [10, 5]


def test_the_planner_imports_neither_lightning_nor_torch_distributed():
    for path in PLAN_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("lightning.", "pytorch_lightning", "torch.distributed")) and \
                    name != "lightning", f"{path.name} imports {name}"


# ---------------------------------------------------------------------------------------------- the CLI
def test_cli_json_has_the_promised_keys(capsys):
    code = cli_main(["plan", "islands.sync_every=24", "islands.fragments=4", "islands.overlap_steps=2",
                     "islands.balance=time", "--step-seconds", "0.3,0.6", "--link-bps", "200M", "--rtt-ms", "1",
                     "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("utilization", "idle_fraction", "peak_bps", "mean_bps", "bytes_per_round", "min_link_bps_for_target"):
        assert key in out, key
    assert len(out["utilization"]) == 2 == len(out["idle_fraction"])
    assert out["inputs"]["fragments"] == 4 and out["inputs"]["numel"] > 1_000_000  # counted from the model
    assert out["min_link_bps_for_target"] > 0


def test_cli_table_from_flops(capsys):
    code = cli_main(["plan", "--hardware", "h100", "--params", "1e9", "--tokens-per-step", "1e6",
                     "--link-bps", "10G", "--rtt-ms", "50", "--tcp-window-mib", "64"])
    assert code == 0
    text = capsys.readouterr().out
    assert "utilization" in text and "smallest link for utilization >= 0.97" in text


@pytest.mark.parametrize("argv, message", [
    (["islands.sync_every=30", "islands.fragments=4", "--step-seconds", "0.3", "--link-bps", "1G"],
     "but H=30 is not; change islands.sync_every/sync_warmup or islands.fragments"),
    (["--step-seconds", "0.3", "--link-bps", "fast"], "cannot read the rate"),
    (["--link-bps", "1G", "--params", "1e6"], "give --step-seconds"),
    (["--step-seconds", "0.3,0.4,0.5", "--link-bps", "1G"], "one per island"),
    (["islands.nope=1", "--step-seconds", "0.3", "--link-bps", "1G"], "could not compose"),
])
def test_cli_bad_input_is_a_clear_error(argv, message, capsys):
    assert cli_main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err

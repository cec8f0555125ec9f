"""Islands that misbehave: a pseudo-gradient that is not finite, or far larger than the others'.

The round leaves such an island out of the merge (every island decides alike from the round
headers), the island adopts the merged result, and training goes on. Islands are threads (see
``test_streaming``); the link is the in-memory double.
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
from test_streaming import run

from lightning_islands.engine import outer


def test_merge_members_leaves_out_non_finite_and_outlying_norms():
    assert outer.merge_members([1.0, None, 2.0], 16.0) == [0, 2]
    assert outer.merge_members([1.0, math.inf, 1.5], None) == [0, 2]
    assert outer.merge_members([1.0, 1.2, 40.0], 16.0) == [0, 1]
    assert outer.merge_members([1.0, 1.2, 40.0], 0) == [0, 1, 2]
    assert outer.merge_members([0.0, 0.0], 16.0) == [0, 1]  # nobody stepped: nothing to judge by
    assert outer.merge_members([None, None], 16.0) == []


@pytest.mark.parametrize("codec", ["fp32", "int4"])
def test_a_nan_pseudo_gradient_is_left_out_and_its_island_adopts_the_merge(codec, caplog):
    kw = {"codec": codec}
    steps = 12  # rounds end at steps 3, 7, 11 (H=4); island 1 breaks in the second round
    clean = run([2, 1], kw, steps)
    broken = run([2, 1], kw, steps, poison=(1, 5, float("nan")))
    first, second = broken
    assert all(torch.equal(a, b) for a, b in zip(first["globals"], second["globals"]))
    assert all(torch.isfinite(g).all() for g in first["globals"])
    assert [m["islands/islands_left_out"] for m in first["metrics"]] == [0.0, 1.0, 0.0]
    assert "merges without island(s) [1]" in caplog.text
    assert second["headers"][1]["norm"] is None
    # round 1 is the clean run's; round 2 merged island 0 alone, so it differs
    assert torch.equal(first["globals"][0], clean[0]["globals"][0])
    assert not torch.equal(first["globals"][1], clean[0]["globals"][1])
    # the island took the merged model and trained on: its parameters and residual are finite again
    assert all(torch.isfinite(t).all() for t in second["locals"])
    if codec == "int4":
        assert all(torch.isfinite(r).all() for r in second["residual"])


def test_an_outlying_pseudo_gradient_is_left_out_among_three_islands():
    first, _, third = run([1, 1, 1], {}, 8, poison=(2, 1, 100.0))  # island 2's first round moved 100x as far
    assert [m["islands/islands_left_out"] for m in first["metrics"]] == [1.0, 0.0]
    assert third["headers"][0]["norm"] > 16 * first["headers"][0]["norm"]
    assert all(torch.equal(a, b) for a, b in zip(first["globals"], third["globals"]))


def test_every_island_non_finite_stops_the_run_with_the_cause():
    with pytest.raises(Exception, match="training diverged"):
        run([1], {}, 4, poison=(0, 1, float("nan")))


@pytest.mark.parametrize("sizes, bad, kw, found", [
    ([2, 1], 1, {}, 1),
    ([1, 2, 1], 0, {"codec": "int4"}, 1),
    ([2, 1], 1, {"fragments": 2, "overlap_steps": 1}, 2),  # found when the damaged fragment syncs again
], ids=["two islands", "three, the first one bad", "fragments+overlap"])
def test_an_island_whose_global_state_drifted_is_repaired_from_the_others(sizes, bad, kw, found, caplog):
    islands = run(sizes, kw, 16, corrupt=(bad, 1))  # one bit of island `bad`'s anchors flips after round 1
    first = islands[0]
    repaired = [m["islands/islands_repaired"] for m in first["metrics"]]
    assert repaired[found] == 1.0 and sum(repaired) == 1.0
    assert first["metrics"][found]["islands/islands_left_out"] == 1.0  # its pseudo-gradient was off
    for other in islands[1:]:
        assert other["digest"] == first["digest"]
        assert all(torch.equal(a, b) for a, b in zip(first["globals"][found:], other["globals"][found:]))
    assert f"island {bad}'s global state differs" in caplog.text
    # the state went to the drifted island alone: an island in step moved no byte for the repair
    src = min(i for i in range(len(sizes)) if i != bad)
    for i, island in enumerate(islands):
        assert (sum(island["swapped"]) > 0) == (i in (bad, src)), (i, island["swapped"])


def test_the_state_checksum_ignores_the_sharding_and_sees_one_bit():
    from doubles import ThreadGroup, ThreadIsland, run_threads
    from test_engine import SPECS, initial_flat

    from lightning_islands.engine import CanonicalLayout

    flat = initial_flat(3)

    def checksum(size: int, flip: bool = False) -> list[int]:
        shared = ThreadIsland(size)

        def rank(r: int) -> int:
            layout = CanonicalLayout(SPECS, ThreadGroup(shared, r))
            shards = [layout.shard_of(flat, i).clone() for i in range(len(SPECS))]
            if flip and r == 1:
                shards[-1].view(-1)[-1:].view(torch.int32).bitwise_xor_(1 << 30)
            return layout.island_checksum(shards)

        return run_threads([lambda r=r: rank(r) for r in range(size)])

    one, two, three = checksum(1), checksum(2), checksum(3)
    assert len(set(one + two + three)) == 1
    assert checksum(3, flip=True)[0] != one[0]


def _unreachable(tmp_path):
    from lightning_islands.app.launch import free_port
    from lightning_islands.link.island_link import IslandLink

    IslandLink(f"127.0.0.1:{free_port()}", 0, 2, deadline=timedelta(seconds=1))


def _duplicate(tmp_path):
    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.island_link import IslandLink

    coord = Coordinator()
    IslandLink(coord.address, 1, 2, run_id="exp")
    IslandLink(coord.address, 1, 2, run_id="exp")


def _out_of_range(tmp_path):
    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.island_link import IslandLink

    IslandLink(Coordinator().address, 2, 2)


def _silent_peer(tmp_path):
    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.island_link import IslandLink

    coord = Coordinator()
    link = IslandLink(coord.address, 0, 2, run_id="r", deadline=timedelta(seconds=1))
    IslandLink(coord.address, 1, 2, run_id="r")  # joins, then never sends anything
    link.gather_objects("round3", {})


def _mismatch(tmp_path):
    from lightning_islands.engine import CanonicalLayout, IslandSettings
    from lightning_islands.engine.settings import compare_fingerprints

    layout = CanonicalLayout([("w", (4, 4), False)])
    prints = [IslandSettings(sync_every=h).fingerprint(layout, False, "cpu") for h in (25, 50)]
    raise RuntimeError(compare_fingerprints(prints))


def _damaged_checkpoint(tmp_path):
    from lightning_islands.engine import CanonicalLayout
    from lightning_islands.engine.checkpoint import OUTER_DIR, load_outer_state, save_outer_state

    layout = CanonicalLayout([("w", (4, 4), False)])
    params = [torch.randn(4, 4)]
    save_outer_state(tmp_path, {"anchor": params}, params, layout)
    shard = next((tmp_path / OUTER_DIR).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:16])
    load_outer_state(tmp_path, ["anchor"], params, layout, params)


@pytest.mark.parametrize("make, error, needles", [
    (_unreachable, ConnectionError, ["could not reach the coordinator", "lightning-islands coordinator"]),
    (_duplicate, RuntimeError, ["island 1 already joined run 'exp'", "give every launch a fresh LI_RUN_ID"]),
    (_out_of_range, ValueError, ["island index 2 is outside [0, 2)", "LI_ISLAND"]),
    (_silent_peer, Exception, ["islands [1] did not reach 'round3' within deadline_s=1 s", "raise islands.deadline_s"]),
    (_mismatch, RuntimeError, ["island 1 has sync_every=50 but island 0 has sync_every=25",
                               "make their model and island settings equal"]),
    (_damaged_checkpoint, RuntimeError, ["islands_outer", "resume from an earlier one"]),
], ids=["unreachable coordinator", "duplicate index", "index out of range", "silent peer", "mismatched settings",
        "damaged checkpoint"])
def test_every_bad_input_ends_with_its_cause_and_fix_and_loses_nothing(tmp_path, make, error, needles):
    (tmp_path / "keep.txt").write_text("a log line")
    before = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*") if p.is_file())
    with pytest.raises(error) as caught:
        make(tmp_path)
    for needle in needles:
        assert needle in str(caught.value)
    after = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*") if p.is_file())
    if make is not _damaged_checkpoint:  # it made its own (damaged) files before the error
        assert after == before
    else:  # the failed load leaves the checkpoint's files as they were, to mend or set aside
        assert (tmp_path / "keep.txt").read_text() == "a log line"
        assert {p.name for p, _ in after} >= {"keep.txt", ".metadata"} and any(p.suffix == ".distcp" for p, _ in after)

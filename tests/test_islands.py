"""IslandStrategy across real islands: separate torch.distributed.run worlds, gloo, a coordinator."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, SharedLaunches, kill_island_process, launch, launch_together, load_rounds
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_islands import IslandStrategy
from lightning_islands.app.launch import run_islands
from lightning_islands.codecs import default_error_feedback

sys.path.insert(0, str(SCRIPTS))
from islands_regression import Regression, batch_for  # noqa: E402

pytestmark = pytest.mark.slow


def reference_diloco(islands, batch_sizes, steps, H, outer_lr, momentum, nesterov, inner_lr=0.05, warmup=(),
                     lr_warmup=0, momentum_warmup=0):
    """Single-process DiLoCo written from the paper: inner SGD per island (ranks average gradients),
    pseudo-gradients weighted by tokens, outer SGD with (Nesterov) momentum; round r runs
    ``warmup[r]`` steps while the warm-up lasts, then H. Outer round r (from 1) uses
    ``min(1, r / lr_warmup)`` of the outer lr and ``min(1, r / momentum_warmup)`` of the momentum
    (a zero warm-up: all of it). Returns {round: params}."""
    torch.manual_seed(0)
    model = Regression(hidden=8)
    glob = {n: p.detach().clone().double() for n, p in model.named_parameters()}
    buf = None
    out = {}
    r, start = 0, 0
    while start + (h := warmup[r] if r < len(warmup) else H) <= steps:
        deltas, weights = [], []
        for i, (world, bs) in enumerate(zip(islands, batch_sizes)):
            local = {n: t.clone().requires_grad_(True) for n, t in glob.items()}
            for s in range(h):
                step = start + s
                grads = {n: torch.zeros_like(t) for n, t in local.items()}
                for k in range(world):
                    x, y = batch_for(i, k, step, bs)
                    pred = (x.double() @ local["layers.0.weight"].T + local["layers.0.bias"]) @ \
                        local["layers.1.weight"].T + local["layers.1.bias"]
                    loss = torch.nn.functional.mse_loss(pred, y.double())
                    g = torch.autograd.grad(loss, list(local.values()))
                    for n, gi in zip(local, g):
                        grads[n] += gi / world
                with torch.no_grad():
                    for n in local:
                        local[n] -= inner_lr * grads[n]
            deltas.append({n: glob[n] - local[n].detach() for n in glob})
            weights.append(world * bs * h)
        total = sum(weights)
        merged = {n: sum(w / total * d[n] for w, d in zip(weights, deltas)) for n in glob}
        lr_r = outer_lr * (min(1.0, (r + 1) / lr_warmup) if lr_warmup else 1.0)
        m_r = momentum * (min(1.0, (r + 1) / momentum_warmup) if momentum_warmup else 1.0)
        if momentum:
            buf = {n: merged[n].clone() for n in glob} if buf is None else \
                {n: m_r * buf[n] + merged[n] for n in glob}
            step_dir = {n: merged[n] + m_r * buf[n] for n in glob} if nesterov else buf
        else:
            step_dir = merged
        glob = {n: glob[n] - lr_r * step_dir[n] for n in glob}
        out[r + 1] = {n: t.float() for n, t in glob.items()}
        r, start = r + 1, start + h
    return out


def assert_islands_equal(out, rounds_expected, n_islands=2):
    per_island = [load_rounds(out, i) for i in range(n_islands)]
    assert sorted(per_island[0]) == list(range(1, rounds_expected + 1))
    for r in per_island[0]:
        for other in per_island[1:]:
            for name, t in per_island[0][r]["params"].items():
                assert torch.equal(t, other[r]["params"][name]), f"round {r}: {name} differs between islands"
            assert per_island[0][r]["digest"] == other[r]["digest"]
    return per_island


# Runs of islands_regression.py that a test below each reads, launched a group at a time: on 2 cores
# launches at once take less time than one after the other (much of a launch waits, see
# conftest.launch_together). name: (islands, arguments).
SHARED_RUNS = {
    "heterogeneous": ([2, 1], ["--steps", 12, "--H", 4, "--batch-sizes", "4,8", "--val-every", 3]),
    "sync-warmup": ([2, 1], ["--steps", 9, "--H", 3, "--sync-warmup", "1,2", "--batch-sizes", "4,8"]),
    "outer-warmup": ([2, 1], ["--steps", 10, "--H", 2, "--outer-lr-warmup", 4, "--momentum-warmup", 2,
                              "--batch-sizes", "4,8"]),
    "h1": ([1, 1], ["--steps", 5, "--H", 1, "--outer-lr", 1.0, "--momentum", 0.0, "--nesterov", 0,
                    "--batch-sizes", "4,12", "--same-seed", 1]),
    "nan": ([2, 1], ["--steps", 12, "--H", 4, "--nan-island", 1, "--nan-step", 6]),
    "topk:0.25+int4": ([2, 1], ["--steps", 8, "--H", 2, "--codec", "topk:0.25+int4"]),
    # manual optimization, two optimizers with LR schedulers: Lightning counts both optimizers' steps
    # in global_step, so max_steps=8 is 4 batches; a round is H batches that stepped
    "two-optimizers": ([2, 1], ["--steps", 8, "--H", 2, "--two-optimizers", 1]),
    "accumulate-clip": ([2, 1], ["--steps", 8, "--H", 2, "--accumulate", 2, "--clip", 0.5, "--inner", "adamw"]),
    "round-lengths": ([1, 1], ["--steps", 12, "--H", 4, "--steps-per-round", "4,2"]),
    "early-stop": ([1, 1], ["--steps", 20, "--H", 2, "--val-every", 3, "--early-stop-island", 0]),
    "sliced": ([2, 2], ["--steps", 8, "--H", 4, "--batch-sizes", "4,8", "--exchange", "sliced"]),
    "sliced-overlap": ([2, 2], ["--steps", 8, "--H", 4, "--fragments", 2, "--overlap", 1,
                                "--exchange", "sliced"]),
}
STREAMING_ARGS = ["--steps", 16, "--H", 4, "--fragments", 2, "--overlap", 1, "--alpha", 0.5, "--batch-sizes", "4,8",
                  "--codec", "int4", "--inner", "adamw", "--ckpt-every", 7, "--val-every", 3]
BUTTERFLY_ARGS = ["--steps", 8, "--H", 2, "--batch-sizes", "4,8,4,6", "--codec", "int4", "--topology", "butterfly",
                  "--ckpt-every", 5]
# each round flies one inner step; the checkpoint after step 4 is taken with round 1 in flight
BUTTERFLY_OVERLAP_ARGS = ["--steps", 16, "--H", 4, "--batch-sizes", "4,8,4,6", "--codec", "int4", "--topology",
                          "butterfly", "--overlap", 1, "--alpha", 0.5, "--ckpt-every", 4]
RELEASE_0_1_0 = SCRIPTS.parent / "fixtures" / "checkpoint_0.1.0"


def _resuming(name: str, args: list, checkpoint: str):
    """The arguments of a run that resumes the shared run ``name`` (launched with ``args``) from each
    island's ``checkpoint``."""
    return lambda run, out: [*args, "--resume", str(run(name) / "ckpt_island{island}" / checkpoint)]


def _from_release_0_1_0(run, out: Path) -> list:
    """The arguments that resume tests/fixtures/checkpoint_0.1.0 (a copy beside ``out``)."""
    for i in (0, 1):
        shutil.copytree(RELEASE_0_1_0 / f"island{i}.ckpt", out.parent / f"{out.name}_ckpt" / f"island{i}.ckpt")
    return ["--steps", 8, "--H", 2, "--codec", "int4", "--inner", "adamw", "--batch-sizes", "4,8",
            "--resume", str(out.parent / f"{out.name}_ckpt" / "island{island}.ckpt")]


# Runs whose arguments are a function of ``(shared_run, out)`` give them once what they need exists
# (the runs they resume from, a copied checkpoint); "expect_ok": False runs are meant to fail.
SHARED_RUNS.update({
    # streaming: two fragments, each round flying one inner step; resumed from its checkpoint after step 7
    "streaming": ([2, 1], STREAMING_ARGS),
    "streaming-resumed": ([2, 1], _resuming("streaming", STREAMING_ARGS, "step=7.ckpt")),
    # four butterfly islands, resumed from their checkpoints in the middle of round 3
    "butterfly": ([2, 1, 1, 1], BUTTERFLY_ARGS),
    "butterfly-resumed": ([2, 1, 1, 1], _resuming("butterfly", BUTTERFLY_ARGS, "step=5.ckpt")),
    "butterfly-overlap": ([2, 1, 1, 1], BUTTERFLY_OVERLAP_ARGS),
    "butterfly-overlap-resumed": ([2, 1, 1, 1], _resuming("butterfly-overlap", BUTTERFLY_OVERLAP_ARGS, "step=4.ckpt")),
    # island 1's checkpoint after step 4 takes 8 s to write, 3 s past the grace window of island 0
    "long-checkpoint": ([1, 1], ["--steps", 6, "--H", 2, "--ckpt-every", 4, "--grace-s", 5, "--save-delay", "0,8"]),
    "release-0.1.0": ([1, 1], _from_release_0_1_0),
    # island 0 (two processes) trains in 32-true, island 1 in bf16-mixed, island 2 in bf16-true
    "precisions": ([2, 1, 1], ["--steps", 6, "--H", 2, "--batch-sizes", "4,8,8",
                               "--precisions", "32-true,bf16-mixed,bf16-true"]),
    # islands 1 and 2 disagree with island 0 each in one way: the parameters (hidden size 9), subnormals
    "mismatched": ([1, 1, 1], ["--hidden", "8,9,8", "--flush-subnormals", "0,0,1", "--batch-sizes", "4,8,8"],
                   {"expect_ok": False}),
})
# two at a time: four launches at once (a dozen processes on 2 cores) starved islands past the 10 s grace
# window of their start on a CI machine
SHARED_GROUPS = [("heterogeneous", "sync-warmup"), ("outer-warmup", "h1"), ("nan", "topk:0.25+int4"),
                 ("two-optimizers", "accumulate-clip"), ("round-lengths", "early-stop"),
                 ("sliced", "long-checkpoint"), ("sliced-overlap", "streaming"), ("streaming-resumed", "precisions"),
                 ("butterfly", "butterfly-overlap"), ("butterfly-resumed", "release-0.1.0"),
                 ("mismatched", "butterfly-overlap-resumed")]


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """``shared_run(name)``: the output folder of SHARED_RUNS[name] (its logs in ``logs`` there),
    launched the first time a test asks for it together with the rest of its group;
    ``shared_run.launches[name]``: its ``(results, output, seconds)``. A failed launch (of a run
    not meant to fail) fails only the tests that read it (conftest.SharedLaunches)."""

    def job(name: str, run: SharedLaunches):
        islands, args, *options = SHARED_RUNS[name]
        out = tmp_path_factory.mktemp("shared") / name.replace(":", "_")
        args = args(run, out) if callable(args) else args  # what it needs, first
        return (islands, ["islands_regression.py", "--out", out, *args], out / "logs"), \
            (options[0] if options else {}), out

    return SharedLaunches(SHARED_GROUPS, job)


def test_heterogeneous_islands_bit_identical_and_match_reference(shared_run):
    # validation every 3 steps lands mid-round: it must see the global model and leave the local one intact
    out = shared_run("heterogeneous")
    per_island = assert_islands_equal(out, 3)
    ref = reference_diloco([2, 1], [4, 8], steps=12, H=4, outer_lr=0.7, momentum=0.9, nesterov=True)
    for r, params in ref.items():
        for name, t in params.items():
            torch.testing.assert_close(per_island[1][r]["params"][name], t, rtol=1e-5, atol=1e-6)
    m = per_island[0][3]["metrics"]
    assert m["islands/bytes_sent"] == pytest.approx(m["islands/payload_bytes"])  # two islands: one peer
    # different seeds: island 0's initial parameters and buffers crossed the link before round 1
    assert per_island[1][1]["initial_state_broadcast"] is True
    torch.manual_seed(0)
    island0_buffer = Regression(hidden=8).calibration
    for island in (0, 1):
        assert torch.equal(per_island[island][3]["buffers"]["calibration"], island0_buffer)
    first = per_island[0][1]["metrics"]
    assert first["islands/bytes_sent"] > first["islands/payload_bytes"]
    assert m["islands/bytes_received"] > 0 and -1.0 <= m["islands/cosine"] <= 1.0
    assert m["islands/pseudo_grad_norm"] > 0
    # every process destroyed its process groups before the interpreter finalized (see fsdp.destroy_world_at_exit)
    exits = {p.name: p.read_text() for p in out.glob("exit_island*_rank*")}
    assert exits == {"exit_island0_rank0": "False", "exit_island0_rank1": "False", "exit_island1_rank0": "False"}


def test_sliced_islands_move_each_ranks_slice_and_match_reference(shared_run):
    """exchange=sliced between islands of two processes: rank 1 of each moves its slice over lanes of
    its own; the islands stay bit-identical and match DiLoCo."""
    out = shared_run("sliced")
    per_island = assert_islands_equal(out, 2)
    ref = reference_diloco([2, 2], [4, 8], steps=8, H=4, outer_lr=0.7, momentum=0.9, nesterov=True)
    for r, params in ref.items():
        for name, t in params.items():
            torch.testing.assert_close(per_island[1][r]["params"][name], t, rtol=1e-5, atol=1e-6)
    m = per_island[0][2]["metrics"]
    assert m["islands/exchange_chunks"] == 2, "two slices, one per rank (rank 1's over lanes of its own)"
    assert m["islands/bytes_sent"] == pytest.approx(m["islands/payload_bytes"])  # both ranks' bytes, one peer


def test_overlapped_sliced_islands_move_every_ranks_slice_in_its_own_thread(shared_run):
    """exchange=sliced with overlap_steps=1 between islands of two processes: each rank's thread moves
    its slice over the island's second (gloo) group and its own lanes while the ranks train; the
    islands stay bit-identical round after round."""
    out = shared_run("sliced-overlap")
    per_island = assert_islands_equal(out, 4)
    for r in range(1, 5):
        m = per_island[0][r]["metrics"]
        assert m["islands/exchange_chunks"] == 2 and m["islands/fragment"] == (r - 1) % 2
        assert ("islands/seconds_waiting_in_flight" in m) == (r < 4), r  # the last round, at the last step, is not


def test_sync_warmup_rounds_follow_the_schedule_and_match_reference(shared_run):
    # rounds of 1, 2, then H=3 steps: rounds end at steps 1, 3, 6, 9
    out = shared_run("sync-warmup")
    per_island = assert_islands_equal(out, 4)
    assert [per_island[1][r]["inner_steps"] for r in (1, 2, 3, 4)] == [1, 3, 6, 9]
    assert [per_island[0][r]["metrics"]["islands/steps_per_round"] for r in (1, 2, 3)] == [2, 3, 3]
    ref = reference_diloco([2, 1], [4, 8], steps=9, H=3, outer_lr=0.7, momentum=0.9, nesterov=True, warmup=[1, 2])
    assert sorted(ref) == [1, 2, 3, 4]
    for r, params in ref.items():
        for name, t in params.items():
            torch.testing.assert_close(per_island[1][r]["params"][name], t, rtol=1e-5, atol=1e-6)


def test_outer_warmup_ramps_lr_and_momentum_and_matches_reference(shared_run):
    # 5 rounds of H=2: the outer lr reaches 0.7 in round 4, the momentum 0.9 in round 2
    out = shared_run("outer-warmup")
    per_island = assert_islands_equal(out, 5)
    metrics = [per_island[0][r]["metrics"] for r in range(1, 6)]
    assert [m["islands/outer_lr"] for m in metrics] == pytest.approx([0.175, 0.35, 0.525, 0.7, 0.7])
    assert [m["islands/outer_momentum"] for m in metrics] == pytest.approx([0.45, 0.9, 0.9, 0.9, 0.9])
    ref = reference_diloco([2, 1], [4, 8], steps=10, H=2, outer_lr=0.7, momentum=0.9, nesterov=True,
                           lr_warmup=4, momentum_warmup=2)
    plain = reference_diloco([2, 1], [4, 8], steps=10, H=2, outer_lr=0.7, momentum=0.9, nesterov=True)
    for r, params in ref.items():
        for name, t in params.items():
            torch.testing.assert_close(per_island[1][r]["params"][name], t, rtol=1e-5, atol=1e-6)
    # the warm-up moved the run: without it the first round already lands elsewhere
    assert not torch.allclose(ref[1]["layers.0.weight"], plain[1]["layers.0.weight"], rtol=1e-3, atol=1e-5)


def test_h1_plain_averaging_equals_synchronous_parameter_averaging(shared_run):
    out = shared_run("h1")
    per_island = assert_islands_equal(out, 5)
    # the same seed gives the same initial state: the digests agree and nothing else is sent
    for island in (0, 1):
        assert per_island[island][1]["initial_state_broadcast"] is False
        first = per_island[island][1]["metrics"]
        assert first["islands/bytes_sent"] == pytest.approx(first["islands/payload_bytes"])
    # synchronous data parallel with parameter averaging after every step, weighted by batch size
    torch.manual_seed(0)
    model = Regression(hidden=8)
    glob = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(5):
        new = {n: torch.zeros_like(t) for n, t in glob.items()}
        for i, bs in enumerate([4, 12]):
            m = Regression(hidden=8)
            m.load_state_dict(glob, strict=False)  # parameters only; the buffer is unused
            x, y = batch_for(i, 0, step, bs)
            torch.nn.functional.mse_loss(m(x), y).backward()
            for n, p in m.named_parameters():
                new[n] += (bs / 16) * (p.detach() - 0.05 * p.grad)
        glob = new
        for n, t in glob.items():
            torch.testing.assert_close(per_island[0][step + 1]["params"][n], t, rtol=1e-5, atol=1e-6)


RESUME_ARGS = ["--H", 4, "--inner", "adamw", "--batch-sizes", "4,8", "--codec", "int4", "--outer-lr-warmup", 3,
               "--momentum-warmup", 3]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """The runs the resume tests read, in three stages of launches at once (islands of 2 and 1
    processes, H=4; int4 with error feedback, whose residual must travel with a checkpoint too; an
    outer warm-up over 3 rounds, which must continue where it stopped):

    1. ``full``, 12 steps uninterrupted (rounds 1-3); ``part``, stopped after 8 steps (round 2)
       with a checkpoint after step 6 (mid-round 2) and its final checkpoint, taken after the
       islands agreed to stop;
    2. ``resumed`` from part's step-6 checkpoint to 12 steps; ``more``, a raised max_steps (12)
       from part's final checkpoint; ``eval``, part's step-6 checkpoint validated in a fresh
       process;
    3. from part's final checkpoint, ``uneven1`` with 4 more steps for island 0 and none for
       island 1 (one process), and ``uneven0`` the other way round (island 0: two processes).

    Returns ``{name: output folder}``, and the stage-3 launches' ``(seconds, output)``."""
    base, common = tmp_path_factory.mktemp("resume"), RESUME_ARGS
    out = {name: base / name for name in ("full", "part", "resumed", "more", "eval", "uneven0", "uneven1")}
    launch_together(([2, 1], ["islands_regression.py", "--out", out["full"], "--steps", 12, *common], base / "l1"),
                    ([2, 1], ["islands_regression.py", "--out", out["part"], "--steps", 8, "--ckpt-every", 6,
                              "--final-ckpt", 1, *common], base / "l2"))
    step6, final = out["part"] / "ckpt_island{island}" / "step=6.ckpt", out["part"] / "final_island{island}.ckpt"
    launch_together(([2, 1], ["islands_regression.py", "--out", out["resumed"], "--steps", 12, *common,
                              "--resume", step6], base / "l3"),
                    ([2, 1], ["islands_regression.py", "--out", out["more"], "--steps", 12, *common,
                              "--resume", final], base / "l4"),
                    # validating the mid-round checkpoint in a fresh process evaluates the global weights (round 1)
                    ([2], ["islands_regression.py", "--out", out["eval"], "--val-every", 1, "--eval-ckpt",
                           str(step6).format(island=0)], base / "l5"))
    uneven = {}

    def timed(name: str, steps: str) -> None:
        t0 = time.monotonic()
        _, text = launch([2, 1], ["islands_regression.py", "--out", out[name], "--steps", steps, *common,
                                  "--deadline-s", 120, "--resume", final], base / name)
        uneven[name] = (time.monotonic() - t0, text)

    threads = [threading.Thread(target=timed, args=args) for args in (("uneven1", "12,8"), ("uneven0", "8,12"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(uneven) == {"uneven0", "uneven1"}, "a launch of stage 3 failed (its error is above)"
    return out, uneven


def test_resume_from_checkpoints_is_exact(resume_runs):
    out, _ = resume_runs
    part = out["part"]
    evaluated = torch.load(out["eval"] / "eval_params.pt")
    global_round1 = load_rounds(part, 0)[1]["params"]
    for name, t in global_round1.items():
        assert torch.equal(evaluated[name], t), f"validate(ckpt_path) did not load the global {name}"
    # the outer warm-up (3 rounds) continues where it stopped: rounds 2 and 3 take 2/3 and all of the outer step
    a, b, b1 = load_rounds(out["full"], 1), load_rounds(out["resumed"], 0), load_rounds(out["resumed"], 1)
    assert sorted(b) == sorted(b1) == [2, 3]
    assert [b[r]["metrics"]["islands/outer_lr"] for r in (2, 3)] == pytest.approx([0.7 * 2 / 3, 0.7])
    for r in (2, 3):
        for name, t in a[r]["params"].items():
            assert torch.equal(t, b[r]["params"][name]), f"resumed round {r}: {name} differs"
        assert a[r]["digest"] == b[r]["digest"] == b1[r]["digest"]


def test_a_checkpoint_of_release_0_1_0_resumes_bit_identically(shared_run):
    """tests/fixtures/checkpoint_0.1.0 holds the step-4 checkpoints of both islands and the global
    state of rounds 3 and 4 of the same run, written by release 0.1.0 (commit 7b36b34, before the
    engine left the strategy) with `--steps 8 --H 2 --codec int4 --inner adamw --ckpt-every 4`:
    resumed today (the shared run "release-0.1.0", from a copy), the run continues bit for bit on a
    machine with the recording one's CPU kernels, and to float32 rounding on others."""
    out = shared_run("release-0.1.0")
    want = torch.load(RELEASE_0_1_0 / "rounds_3_4.pt", weights_only=False)
    got, other = load_rounds(out, 0), load_rounds(out, 1)
    assert sorted(got) == sorted(other) == [2, 3, 4]  # the step-4 checkpoint precedes round 2's outer step
    for r in (3, 4):
        assert got[r]["digest"] == other[r]["digest"], f"round {r}: the islands differ"
        if got[r]["digest"] == want[r]["digest"]:
            continue  # this machine's CPU kernels are the recording machine's: bit for bit
        # Another CPU's kernels (an AMD EPYC with AVX-512 here) round matmuls differently in the last
        # bit: the continuation then agrees to float32 rounding (2-6e-8 seen), where a checkpoint read
        # wrongly (outer momentum, anchors, the step) moves parameters by 1e-4 or more.
        for name, t in want[r]["params"].items():
            torch.testing.assert_close(got[r]["params"][name], t, rtol=1e-6, atol=1e-6, msg=f"round {r}: {name}")


def test_streaming_islands_stay_bit_identical_and_resume_exactly(shared_run):
    """Two fragments, each round flying one inner step while training goes on: validation mid-flight,
    a checkpoint that lands the round in flight, and a resume from it that continues bit for bit.
    The resume starts from the uninterrupted run's own checkpoint after step 7: a run stopped at
    step 7 writes the same one, tensor for tensor (the round in flight lands at the checkpoint)."""
    full = shared_run("streaming")
    assert sorted(p.name for p in (full / "ckpt_island0").iterdir()) == ["step=14.ckpt", "step=7.ckpt"]
    resumed = shared_run("streaming-resumed")
    per_island = assert_islands_equal(full, 8)
    assert [per_island[0][r]["metrics"]["islands/fragment"] for r in range(1, 9)] == [0, 1] * 4
    a, b = per_island[1], load_rounds(resumed, 0)
    assert sorted(b) == list(range(4, 9))  # rounds 1-3 landed before the checkpoint at step 7
    for r in b:
        for name, t in a[r]["params"].items():
            assert torch.equal(t, b[r]["params"][name]), f"resumed round {r}: {name} differs"
        assert a[r]["digest"] == b[r]["digest"]


@pytest.mark.parametrize("run, resumed_at", [("butterfly", 3), ("butterfly-overlap", 1)],
                         ids=["synchronous", "overlapped"])
def test_four_butterfly_islands_keep_each_stage_identical_and_resume_exactly(shared_run, run, resumed_at):
    """Four islands (one of two processes) in butterfly stages: after each round the islands of its
    stage's pairs hold the same global state and the others differ; a resume from a checkpoint in
    the middle of round 3 (each island's own state, momentum and bases) continues bit for bit.
    Overlapped: every round flies an inner step, and the checkpoint is taken with round 1 in flight."""
    full, resumed = shared_run(run), shared_run(f"{run}-resumed")
    rounds = [load_rounds(full, i) for i in range(4)]
    again = [load_rounds(resumed, i) for i in range(4)]
    for r in range(1, 5):
        pairs = [(0, 1), (2, 3)] if r % 2 else [(0, 2), (1, 3)]  # stage 0, then stage 1, in turn
        for a, b in pairs:
            assert rounds[a][r]["params"].keys() == rounds[b][r]["params"].keys()
            for name, t in rounds[a][r]["params"].items():
                assert torch.equal(t, rounds[b][r]["params"][name]), f"round {r}: islands {a}, {b} differ ({name})"
        assert rounds[0][r]["digest"] != rounds[3][r]["digest"]
        assert rounds[0][r]["metrics"]["islands/butterfly_stage"] == (r - 1) % 2
        # the round flew (its waiting counted apart) unless it was the last, which ends the run at once
        assert ("islands/seconds_waiting_in_flight" in rounds[0][r]["metrics"]) == (run.endswith("overlap") and r < 4)
    for i in range(4):
        assert sorted(again[i]) == list(range(resumed_at, 5))
        for r in range(resumed_at, 5):
            for name, t in rounds[i][r]["params"].items():
                assert torch.equal(t, again[i][r]["params"][name]), f"island {i}, resumed round {r}: {name} differs"
            assert rounds[i][r]["digest"] == again[i][r]["digest"]


@pytest.mark.parametrize("overlap, fragments", [(0, 1), (1, 1), (1, 2)],
                         ids=["synchronous", "overlapped", "overlapped-fragments"])
def test_a_slow_island_with_max_staleness_is_not_waited_for_and_its_work_arrives_late(tmp_path, overlap, fragments):
    """Three islands, island 2 three times slower per step. With max_staleness=4 the others do not
    wait for it past staleness_wait_s (seen in the log; the grace window, for dead islands, is far
    longer): they finish all their rounds, island 2's work is merged late, never older than 4 rounds,
    and every island that took part in a round holds its state. Overlapped: each round flies an
    inner step, and island 2's round thread catches it up while it trains (with two fragments, in
    its snapshot's fragment's next round)."""
    out = tmp_path / "async"
    _, text = launch([1, 1, 1], ["islands_regression.py", "--out", out, "--steps", 24, "--H", 4, "--batch-sizes",
                                 "4,8,6", "--delays", "0.15,0.15,0.45", "--grace-s", 60, "--staleness-wait-s", 0.3,
                                 "--max-staleness", 4, "--overlap", overlap, "--fragments", fragments],
                     tmp_path / "logs")
    rounds = {i: load_rounds(out, i) for i in range(3)}
    assert sorted(rounds[0]) == sorted(rounds[1]) == list(range(1, 6 * fragments + 1)), text[-3000:]
    # once it passed the wait for slow islands, or at once when its status said it would arrive later
    assert re.search(r"goes on without islands \[2\] \((alive but slower|they report arriving later) than the wait "
                     r"for slow islands, 0.3 s\)", text), text[-3000:]
    ages = [saved["metrics"]["islands/staleness"] for saved in rounds[2].values()]
    assert 1 <= max(ages) <= 4 and all(a <= 4 for a in ages), ages
    caught = re.findall(r"island 2 was late for round (\d+); it joins round (\d+) with its work pending", text)
    assert caught, text[-3000:]
    if overlap:  # its thread's snapshot is of the late round's fragment: it joins that fragment's next round
        assert all((int(b) - int(a)) % fragments == 0 and int(b) > int(a) for a, b in caught), caught
    flown = ["islands/seconds_waiting_in_flight" in saved["metrics"] for saved in rounds[2].values()]
    assert any(flown) == bool(overlap), flown
    assert sum(saved["metrics"]["islands/stale_merged"] for saved in rounds[0].values()) >= 1
    for r, saved in rounds[2].items():
        assert all(torch.equal(t, rounds[0][r]["params"][n]) for n, t in saved["params"].items()), f"round {r}"


def test_a_resume_with_an_island_behind_merges_its_pending_work_once(tmp_path):
    """max_staleness=2: islands 0 and 1 resume from their step-10 checkpoints (round 2 done: a round
    runs when the step after it starts), island 2 from its step-6 one (its work since round 1
    pending). The others do not wait for it; it finds its round passed over, joins the next one and
    its pending work (the 2 steps before the checkpoint and the 2 after) is merged there once, 2
    rounds old, after which every island holds one state."""
    first, again = tmp_path / "first", tmp_path / "again"
    common = ["--H", 4, "--batch-sizes", "4,8,6", "--max-staleness", 2, "--grace-s", 1.0]
    launch([1, 1, 1], ["islands_regression.py", "--out", first, "--steps", 12, "--ckpt-every", 2, *common],
           tmp_path / "l1")
    picked = tmp_path / "picked"
    for island, step in ((0, 10), (1, 10), (2, 6)):
        shutil.copytree(first / f"ckpt_island{island}" / f"step={step}.ckpt", picked / f"island{island}.ckpt")
    # islands 0 and 1 hold after step 14 until island 2 asks to be taken back, however slow its start
    _, text = launch([1, 1, 1], ["islands_regression.py", "--out", again, "--steps", 16, *common, "--hold-for-rejoin",
                                 14, "--rejoiner", 2, "--resume", str(picked / "island{island}.ckpt")], tmp_path / "l2")
    ours, late = load_rounds(again, 0), load_rounds(again, 2)
    assert sorted(ours) == [3, 4] and sorted(late) == [4], text[-3000:]
    assert "island 2 was late for round 1; it joins round 3" in text, text[-3000:]
    assert late[4]["metrics"]["islands/staleness"] == 2.0 and ours[4]["metrics"]["islands/stale_merged"] == 1.0
    assert ours[3]["metrics"]["islands/stale_merged"] == 0.0
    # 4 steps of tokens, as in a round of the first run: none lost across the restart, none counted twice
    assert late[4]["metrics"]["islands/round_tokens"] == load_rounds(first, 2)[1]["metrics"]["islands/round_tokens"]
    assert all(torch.equal(t, ours[4]["params"][n]) for n, t in late[4]["params"].items())


def test_an_island_whose_step_turns_nan_is_left_out_and_trains_on(shared_run):
    out = shared_run("nan")
    per_island = assert_islands_equal(out, 3)
    assert [per_island[0][r]["metrics"]["islands/islands_left_out"] for r in (1, 2, 3)] == [0.0, 1.0, 0.0]
    for params in per_island[1][3]["params"].values():
        assert torch.isfinite(params).all()
    assert "merges without island(s) [1]" in (out / "logs" / "island0.log").read_text()


def test_a_damaged_checkpoint_is_named_with_the_fix(resume_runs, tmp_path):
    part = resume_runs[0]["part"]
    assert sorted(p.name for p in (part / "ckpt_island0").iterdir()) == ["step=6.ckpt"]  # nothing staged is left
    for i in (0, 1):  # a copy: the other tests read the shared run's checkpoints
        shutil.copytree(part / f"ckpt_island{i}" / "step=6.ckpt", tmp_path / f"ckpt_island{i}" / "step=6.ckpt")
    ckpt = tmp_path / "ckpt_island0" / "step=6.ckpt"
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:64])  # a write cut short
    results, text = launch([2, 1], ["islands_regression.py", "--out", tmp_path / "resumed", "--steps", 12,
                                    *RESUME_ARGS, "--resume", str(tmp_path / "ckpt_island{island}" / "step=6.ckpt")],
                           tmp_path / "logs", expect_ok=False)
    assert results[0].returncode != 0
    assert f"could not read the checkpoint {ckpt}" in text and "resume from an earlier checkpoint" in text


@pytest.mark.parametrize("island1", ["same", "other", "none"])
def test_islands_sign_their_payloads_with_a_shared_secret(tmp_path, island1):
    secret = "a secret of 32 bytes, not more.."
    env1 = {"same": {"LI_SECRET": secret}, "other": {"LI_SECRET": "another secret, 32 bytes long..."},
            "none": {}}[island1]
    buf = io.StringIO()
    results = run_islands([1, 1], [sys.executable, str(SCRIPTS / "islands_regression.py"), "--out", str(tmp_path),
                                   "--steps", "8", "--deadline-s", "20"],
                          log_dir=tmp_path / "logs", live=False, out=buf, env={"OMP_NUM_THREADS": "1"},
                          island_env=[{"LI_SECRET": secret}, env1])
    text = buf.getvalue()
    if island1 == "same":
        assert all(r.returncode == 0 for r in results), text[-4000:]
        assert_islands_equal(tmp_path, 2)
        return
    assert all(r.returncode != 0 for r in results)
    assert not list(tmp_path.glob("island*_round*.pt")), "no round may run"
    if island1 == "none":  # island 1's plain values carry no MAC; island 0's sealed ones are no JSON to island 1
        assert "island 1 runs without the run's secret while island 0 has one" in text, text[-4000:]
        assert "island 1 cannot read the value under" in text and "island 1 runs without one" in text, text[-4000:]
    else:
        assert "island 1's" in text and "give every island the same secret" in text


def test_training_on_from_the_final_checkpoint_continues_the_rounds(resume_runs):
    out, uneven = resume_runs
    # the final checkpoint is taken after the islands agreed to stop; a raised max_steps trains on
    a, b, b1 = load_rounds(out["full"], 0), load_rounds(out["more"], 0), load_rounds(out["more"], 1)
    assert sorted(b) == sorted(b1) == [3], "the resumed run must merge its steps in round 3"
    assert a[3]["digest"] == b[3]["digest"] == b1[3]["digest"]
    for name, t in a[3]["params"].items():
        assert torch.equal(t, b[3]["params"][name]), f"round 3: {name} differs from the uninterrupted run"
    # Lightning skips on_train_start when a fit has no steps left; such an island (here island 1, one
    # process) still takes part in the start agreement (from teardown), so its partner stops at once
    # instead of waiting deadline_s (120 s) for a round that never comes
    seconds, text = uneven["uneven1"]
    assert seconds < 90, "island 0 waited for island 1, which had no steps left"
    assert "not every island has steps left" in text
    assert not list(out["uneven1"].glob("island*_round*.pt"))


def test_a_multi_process_island_without_steps_left_tells_the_others_at_once(resume_runs):
    # island 0 (2 processes) resumes at its max_steps: Lightning skips on_train_start, and the start
    # agreement runs from teardown, a collective of the island: both of its ranks must take part
    out, uneven = resume_runs
    seconds, text = uneven["uneven0"]
    assert seconds < 90, "island 1 waited for island 0, which had no steps left"
    assert "not every island has steps left" in text
    assert not list(out["uneven0"].glob("island*_round*.pt"))


def test_an_island_writing_a_long_checkpoint_is_waited_for(shared_run):
    """A checkpoint write longer than grace_s is progress, not silence: the leader's beat follows
    its progress while it writes, so the island that waits for it at the next round does not give
    it up."""
    # 8 s of writing: island 0 waits for it at the next round's exchange, 3 s past the 5 s of silence
    # (grace_s) after which it would give island 1 up without the beats
    out = shared_run("long-checkpoint")
    assert shared_run.launches["long-checkpoint"][2] > 8, "island 1's checkpoint write should have taken 8 s"
    assert (out / "ckpt_island1" / "step=4.ckpt").is_dir()
    assert_islands_equal(out, 3)


@pytest.fixture(scope="module")
def mismatched_run(shared_run):
    """One launch (shared, "mismatched") of three islands that disagree with island 0 each in one way:
    island 1 in its parameters (hidden size 9), island 2 in flushing subnormal floats. The start
    agreement names every difference of every island, so one launch shows both messages."""
    out = shared_run("mismatched")
    results, text, _ = shared_run.launches["mismatched"]
    return out, results, text


@pytest.mark.parametrize("island, needle", [(1, "parameters"), (2, "subnormals")], ids=["parameters", "subnormals"])
def test_mismatched_islands_fail_fast_with_a_clear_message(mismatched_run, island, needle):
    out, results, text = mismatched_run
    assert all(r.returncode != 0 for r in results)
    assert "islands disagree before the first step" in text
    assert f"island {island} has {needle}=" in text
    assert not list(out.glob("island*_round*.pt")), "no outer step may run after a mismatch"


def test_islands_on_one_machine_share_its_cores(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    probe = tmp_path / "probe.py"
    # one os.write per process: the two ranks of island 0 share a pipe, and an unbuffered print
    # (PYTHONUNBUFFERED=1) writes its pieces separately, so two ranks' lines could interleave
    probe.write_text("import os, torch\n"
                     "line = f\"threads {os.environ['OMP_NUM_THREADS']} {torch.get_num_threads()}\\n\"\n"
                     "os.write(1, line.encode())\n")
    buf = io.StringIO()
    results = run_islands([2, 1], [sys.executable, str(probe)], log_dir=tmp_path, live=False, out=buf)
    assert all(r.returncode == 0 for r in results), buf.getvalue()
    expected = max(1, len(os.sched_getaffinity(0)) // 3)
    lines = [line.split("threads ")[1] for line in buf.getvalue().splitlines() if "threads " in line]
    assert lines == [f"{expected} {expected}"] * 3, buf.getvalue()
    # an explicit setting wins
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    buf = io.StringIO()
    run_islands([1], [sys.executable, str(probe)], log_dir=tmp_path / "explicit", live=False, out=buf)
    assert "threads 1 1" in buf.getvalue()
    # an empty setting (libgomp: "Invalid value", then its own default) counts as unset
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    buf = io.StringIO()
    run_islands([2, 1], [sys.executable, str(probe)], log_dir=tmp_path / "empty", live=False, out=buf)
    lines = [line.split("threads ")[1] for line in buf.getvalue().splitlines() if "threads " in line]
    assert lines == [f"{expected} {expected}"] * 3, buf.getvalue()


def test_run_command_names_the_failing_island(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_islands.app.cli", "run", "--islands", "1,1", "--live", "off", "--",
         sys.executable, str(SCRIPTS / "islands_regression.py"), "--out", str(tmp_path), "--fail-island", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    assert "island 1 failed with exit code" in proc.stderr
    assert "island 1 was told to fail" in proc.stderr + proc.stdout


@pytest.mark.parametrize("codec", ["topk:0.25+int4"])  # the others, across shardings: tests/test_engine.py
def test_a_quantized_codec_keeps_global_state_bit_identical(shared_run, codec):
    out = shared_run(codec)  # islands_regression.py --steps 8 --H 2 --codec CODEC
    per_island = assert_islands_equal(out, 4)
    m = per_island[0][4]["metrics"]
    assert m["islands/compression_ratio"] > 1.0
    assert 0.0 < m["islands/quant_rel_error"] < 1.0


@pytest.fixture(scope="module")
def time_balanced_run(tmp_path_factory):
    """A time-balanced run (island 1 0.12 s slower a step, 4 rounds of H=3) launched with live status
    lines: ``(output folder, the launcher's output)``. Read by the time-balance test and by the live
    status test."""
    out = tmp_path_factory.mktemp("balanced")
    _, text = launch([1, 1], ["islands_regression.py", "--out", out, "--steps", 400, "--H", 3, "--delays", "0,0.12",
                              "--balance", "time", "--max-rounds", 4, "--batch-sizes", "8,8"], out / "logs", live=True)
    return out, text


def test_time_balanced_rounds_differ_in_steps_and_stay_bit_identical(time_balanced_run):
    tmp_path, _ = time_balanced_run
    per_island = assert_islands_equal(tmp_path, 4)
    fast = [per_island[0][r]["inner_steps"] for r in range(1, 5)]
    slow = [per_island[1][r]["inner_steps"] for r in range(1, 5)]
    assert fast[0] == slow[0] == 3, "the first round runs H steps everywhere"
    assert slow[-1] - slow[0] == 9, "the slowest island keeps H steps per round"
    assert fast[-1] - fast[0] > 2 * (slow[-1] - slow[0]), f"fast island should run more steps: {fast} vs {slow}"
    m_fast, m_slow = per_island[0][4]["metrics"], per_island[1][4]["metrics"]
    assert m_fast["islands/steps_per_round"] > m_slow["islands/steps_per_round"] == 3
    # max_rounds ends training with the last round: no inner step after it (it would be merged nowhere)
    for i, steps in ((0, fast[-1]), (1, slow[-1])):
        assert int((tmp_path / f"island{i}_steps").read_text()) == steps, f"island {i} stepped past round 4"
    # tokens weight the merge: the fast island processed more in the round
    assert m_fast["islands/round_tokens"] > m_slow["islands/round_tokens"]


def test_time_balance_does_not_count_the_first_step_of_a_fit(tmp_path):
    # equal islands, but island 0's first batch takes 1.5 s longer (a slow data loader start): the
    # round-1 plan must still give both islands about H steps (it gave island 1 8x H before)
    launch([1, 1], ["islands_regression.py", "--out", tmp_path, "--steps", 400, "--H", 4, "--delays", "0.1,0.1",
                    "--first-step-delay", "1.5,0", "--balance", "time", "--max-rounds", 2, "--batch-sizes", "8,8"],
           tmp_path / "logs")
    per_island = assert_islands_equal(tmp_path, 2)
    second = [per_island[i][2]["inner_steps"] - per_island[i][1]["inner_steps"] for i in (0, 1)]
    assert all(2 <= n <= 7 for n in second), f"round 2 steps per island: {second}"


@pytest.mark.parametrize("name, rounds", [
    ("two-optimizers", 2),  # manual optimization, two optimizers with LR schedulers (see SHARED_RUNS)
    ("accumulate-clip", 4),  # gradient accumulation and clipping
], ids=["two-optimizers", "accumulate-clip"])
def test_lightning_features_keep_working_under_islands(shared_run, name, rounds):
    out, args = shared_run(name), SHARED_RUNS[name][1]
    per_island = assert_islands_equal(out, rounds)
    accumulate = args[args.index("--accumulate") + 1] if "--accumulate" in args else 1
    assert per_island[0][rounds]["inner_steps"] == 2 * rounds
    m = per_island[0][rounds]["metrics"]
    assert m["islands/round_tokens"] == 2 * accumulate * 4 * 2 * 6  # 2 steps x micro-batches x 2 ranks x (4 x DIM)
    assert m["islands/pseudo_grad_norm"] > 0


@pytest.fixture(scope="module")
def precision_run(shared_run):
    """One launch (shared, "precisions") for both precision cases: island 0 (two processes) trains in
    32-true, island 1 in bf16-mixed, island 2 in bf16-true; 6 steps, H=2."""
    return shared_run("precisions")


@pytest.mark.parametrize("island", [1, 2], ids=["32-true,bf16-mixed", "32-true,bf16-true"])
def test_islands_with_different_precision_share_one_fp32_global_state(precision_run, island):
    """The 32-true island 0 and island ``island`` of precision_run (1: bf16-mixed, 2: bf16-true) hold
    one fp32 global state, bit for bit."""
    per_island = assert_islands_equal(precision_run, 3, n_islands=3)
    assert all(t.dtype == torch.float32 for t in per_island[island][3]["params"].values())


@pytest.mark.parametrize("devices, outer_device, expected", [
    (["cuda:0"], None, "cuda:0"),  # a GPU island quantizes, decodes and merges on its GPU, chunk by chunk
    (["cuda:0", "cuda:1"], None, "cuda:0"),
    (["cuda:0"], "cpu", "cpu"),
    (["cpu", "cpu"], None, "cpu"),
])
def test_where_the_leader_runs_the_exchange(devices, outer_device, expected):
    env = LightningEnvironment()
    env.set_world_size(len(devices))
    strategy = IslandStrategy(sync_every=2, outer_device=outer_device)
    strategy.cluster_environment = env
    strategy.parallel_devices = [torch.device(d) for d in devices]
    assert strategy._exchange_device() == torch.device(expected)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("accelerators, precisions, codec", [
    # a GPU island (NCCL inside, Triton codec kernels, bf16) beside a CPU island (gloo)
    ("gpu,cpu", "bf16-mixed,32-true", "int4"),
    ("gpu,cpu", "32-true,32-true", "sign"),
    ("gpu,gpu", "bf16-mixed,bf16-mixed", "fp8"),
], ids=["gpu-cpu-int4", "gpu-cpu-sign", "gpu-gpu-fp8"])
def test_gpu_and_cpu_islands_keep_one_global_state(tmp_path, accelerators, precisions, codec):
    launch([1, 1], ["islands_regression.py", "--out", tmp_path, "--steps", 8, "--H", 2, "--codec", codec,
                    "--accelerators", accelerators, "--precisions", precisions], tmp_path / "logs")
    per_island = assert_islands_equal(tmp_path, 4)
    assert all(t.dtype == torch.float32 for t in per_island[0][4]["params"].values())
    m = per_island[0][4]["metrics"]
    assert m["islands/compression_ratio"] > 1.0 and 0.0 < m["islands/quant_rel_error"] < 1.0
    # a one-process GPU island quantizes on its GPU (error feedback lives there), a CPU island on the host
    if default_error_feedback(codec):
        expected = ["cuda:0" if a == "gpu" else "cpu" for a in accelerators.split(",")]
        assert [per_island[i][4]["ef_device"] for i in (0, 1)] == expected


@needs_cuda
def test_a_gpu_island_beside_a_cpu_island_of_two_processes_exchanges_sliced(tmp_path):
    """exchange=sliced between a one-process GPU island (its slice gathered, encoded and merged on the
    GPU) and a CPU island of two processes (gloo): both hold one global state after every round."""
    launch([1, 2], ["islands_regression.py", "--out", tmp_path, "--steps", 8, "--H", 2, "--codec", "int4",
                    "--accelerators", "gpu,cpu", "--batch-sizes", "4,8", "--exchange", "sliced"], tmp_path / "logs")
    per_island = assert_islands_equal(tmp_path, 4)
    assert per_island[0][4]["metrics"]["islands/exchange_chunks"] >= 1


@needs_cuda
def test_gpu_island_matches_the_reference(tmp_path):
    launch([1, 1], ["islands_regression.py", "--out", tmp_path, "--steps", 8, "--H", 4, "--batch-sizes", "4,8",
                    "--accelerators", "gpu,cpu"], tmp_path / "logs")
    per_island = assert_islands_equal(tmp_path, 2)
    ref = reference_diloco([1, 1], [4, 8], steps=8, H=4, outer_lr=0.7, momentum=0.9, nesterov=True)
    for r, params in ref.items():
        for name, t in params.items():
            torch.testing.assert_close(per_island[0][r]["params"][name], t, rtol=1e-4, atol=1e-5)


def test_islands_with_different_round_lengths_stop_together(shared_run):
    """Island 0 runs 4 steps per round, island 1 runs 2: island 0 reaches max_steps after 3 rounds and
    its last round tells island 1 to stop there too, instead of island 1 waiting for a 4th round."""
    out = shared_run("round-lengths")
    per_island = assert_islands_equal(out, 3)
    assert [per_island[1][r]["inner_steps"] for r in (1, 2, 3)] == [2, 4, 6]
    assert (out / "island1_done").read_text() == "3"


def test_early_stopping_on_one_island_stops_every_island_after_the_same_round(shared_run):
    """Island 0's EarlyStopping fires at its validation after step 3 (mid-round, H=2): its partial round 2
    is its last and says so; island 1 finishes round 2 (step 4) and stops there instead of waiting."""
    out = shared_run("early-stop")
    per_island = assert_islands_equal(out, 2)
    assert [per_island[0][r]["inner_steps"] for r in (1, 2)] == [2, 3]
    assert [per_island[1][r]["inner_steps"] for r in (1, 2)] == [2, 4]
    assert (out / "island0_done").read_text() == "2" and (out / "island1_done").read_text() == "2"


def test_terminating_the_launcher_stops_every_island(tmp_path):
    import time

    marker = str(tmp_path / "long-run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_islands.app.cli", "run", "--islands", "1,1", "--live", "off", "--",
         sys.executable, str(SCRIPTS / "islands_regression.py"), "--out", marker, "--steps", "100000", "--H", "5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )
    deadline = time.time() + 120
    while not list((tmp_path / "long-run").glob("island1_round*.pt")) and time.time() < deadline:
        time.sleep(0.5)
    assert list((tmp_path / "long-run").glob("island1_round*.pt")), "islands never reached an outer step"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not left, f"island processes survived the launcher: {left}"


def test_live_status_lines_replace_interleaved_logs(time_balanced_run):
    """The launcher's output in live mode, of the time-balanced run (launched with ``live=True``; it
    finished with exit code 0 everywhere, or the fixture fails)."""
    tmp_path, text = time_balanced_run
    assert "island 0: step" in text and "island 1: step" in text and "round" in text
    assert "island 0: done" in text and "island 1: done" in text
    assert "[island 0]" not in text, "in live mode the logs go to files, not the terminal"
    assert (tmp_path / "logs" / "island0.log").read_text()


def _val_loss(params: dict) -> float:
    """The regression's validation loss under ``params`` (the batches of its val_dataloader)."""
    from islands_regression import batch_for

    total = 0.0
    for r in range(2):
        x, y = batch_for(99, r, 0, 4)
        pred = (x @ params["layers.0.weight"].T + params["layers.0.bias"]) @ params["layers.1.weight"].T \
            + params["layers.1.bias"]
        total += float(torch.nn.functional.mse_loss(pred, y))
    return total / 2


HOLD_STEP = 22  # island 0 pauses after this inner step (in round 6) until island 1 asked to rejoin


def _killed_run(tmp_path, phase: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    kill = ["--kill-island", "1", "--kill-phase", phase, "--kill-step", "10", "--kill-round", "3",
            "--hold-for-rejoin", str(HOLD_STEP)]
    islands = "1,1"
    if phase == "slice":  # islands of two processes: island 1's rank 1 dies in its own slice's transfer
        kill, islands = [*kill, "--exchange", "sliced"], "2,2"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_islands.app.cli", "run", "--islands", islands, "--live", "off",
         "--max-restarts", "1", "--", sys.executable, str(SCRIPTS / "islands_regression.py"), "--out", str(tmp_path),
         "--steps", "48", "--H", "4", "--grace-s", "3", "--delays", "0.05", "--deadline-s", "30", *kill],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, load_rounds(tmp_path, 0), load_rounds(tmp_path, 1)


@pytest.mark.parametrize("phase", ["inner", "exchange", "slice"])
def test_a_killed_island_restarts_rejoins_and_ends_bit_identical(tmp_path, phase):
    """SIGKILL island 1's training process during its inner steps, or in an exchange (with
    ``exchange=sliced``: its rank 1, in its own slice's transfer, islands of two processes): island 0
    trains on (stalling at most the grace window), torchrun restarts island 1 (--max-restarts), it
    rejoins from nothing, and from its first round back its global state equals island 0's. Island 0
    pauses in round 6 until island 1 is back or asked to rejoin (an event, not a guess at how long a
    restart takes here), so the rejoin happens on any machine; its stall is measured before that
    pause. After
    the fault in the inner steps, the loss is that of a run without it: the reference DiLoCo of the
    same islands, data and settings (which such a run matches to float32 rounding, 4e-7 here; see
    test_heterogeneous_islands_bit_identical_and_match_reference), at round 12."""
    proc, rounds0, rounds1 = _killed_run(tmp_path / "faults", phase)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "killing island 1" in out and "island 1 rejoins the run at round" in out
    assert f"island 0 holds at step {HOLD_STEP}" in out and "island 1 is back or asked to rejoin" in out
    assert sorted(rounds0) == list(range(1, 13)), "island 0 trained through every round"
    back = sorted(r for r, saved in rounds1.items() if saved["restarted"])
    assert back and back[0] <= HOLD_STEP // 4 + 2 and back[-1] == 12, f"island 1 was back for rounds {back}"
    for r in back:
        for name, t in rounds0[r]["params"].items():
            assert torch.equal(t, rounds1[r]["params"][name]), f"round {r}: {name} differs"
        assert rounds0[r]["digest"] == rounds1[r]["digest"]
    if phase == "slice":  # the restarted island took the state rank by rank, not through its leader
        assert "taking island 0's, slice by slice" in out
    before_hold = [r for r in rounds0 if r <= HOLD_STEP // 4]  # the rounds island 0 ended before its pause
    times = sorted((tmp_path / "faults" / f"island0_round{r}.pt").stat().st_mtime for r in before_hold)
    stall = max(b - a for a, b in zip(times, times[1:]))
    assert stall < 3 + 4.0, f"island 0 stalled {stall:.1f} s between rounds (grace 3 s)"
    if phase == "inner":
        clean = reference_diloco([1, 1], [4, 8], steps=48, H=4, outer_lr=0.7, momentum=0.9, nesterov=True)
        faulty, base = _val_loss(rounds0[12]["params"]), _val_loss(clean[12])
        assert abs(faulty - base) <= 0.01 * base + 1e-3, f"loss {faulty:.4f} with the fault, {base:.4f} without"


def _resumed(out: Path, first: Path, log_dir: Path, *args) -> tuple[dict, dict, str]:
    """Resume the islands of ``first`` from their round checkpoints into ``out`` (to round 8):
    ``(island 0's rounds, island 1's rounds, output)``, every island's rounds equal."""
    _, text = launch([1, 1], ["islands_regression.py", "--out", out, "--steps", 400, "--H", 4, "--max-rounds", 8,
                              "--resume", first / "rounds_island{island}", "--round-ckpt-every", 1, *args], log_dir)
    rounds0, rounds1 = load_rounds(out, 0), load_rounds(out, 1)
    assert sorted(rounds0) == sorted(rounds1) and max(rounds0) == 8, text[-3000:]
    for r in rounds0:
        assert rounds0[r]["digest"] == rounds1[r]["digest"], f"round {r}: the resumed islands differ"
    return rounds0, rounds1, text


def test_a_lost_coordinator_ends_every_island_naming_it_and_the_run_resumes(tmp_path):
    """The coordinator SIGKILLed mid-run of time-balanced islands (so their steps differ): every
    island ends with an error that names it and the fix (documented in the README), instead of
    hanging; restarted, the islands resume from the last round both kept a checkpoint of, and
    train on bit-identical."""
    from lightning_islands.app.launch import free_port, torchrun_command

    port, first = free_port(), tmp_path / "first"
    balanced = ["--balance", "time", "--delays", "0.02,0.08", "--batch-sizes", "8,8"]
    coordinator = subprocess.Popen([sys.executable, "-m", "lightning_islands.app.cli", "coordinator", "--host",
                                    "127.0.0.1", "--port", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in coordinator.stdout.readline()
        islands = []
        for i in range(2):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "LI_ISLAND": str(i), "LI_NUM_ISLANDS": "2",
                   "LI_COORDINATOR": f"127.0.0.1:{port}", "LI_RUN_ID": "lost"}
            cmd = torchrun_command(1, [sys.executable, str(SCRIPTS / "islands_regression.py"), "--out", str(first),
                                       "--steps", "400", "--H", "4", "--round-ckpt-every", "1", *balanced], free_port())
            islands.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + 120
        while not (first / "rounds_island1" / "round000003.ckpt").exists():
            assert time.monotonic() < deadline, "the islands never checkpointed round 3"
            time.sleep(0.1)
        coordinator.kill()
        lost = time.monotonic()
        outs = [p.communicate(timeout=120)[0] for p in islands]
        ended = time.monotonic() - lost
    finally:
        coordinator.kill()
        for p in islands:
            p.kill()
    for i, (p, out) in enumerate(zip(islands, outs)):
        assert p.returncode != 0, f"island {i} went on without its coordinator"
        assert f"lost the coordinator at 127.0.0.1:{port}" in out and "restart the run from" in out, out[-3000:]
    steps = [{r: s["inner_steps"] for r, s in load_rounds(first, i).items()} for i in (0, 1)]
    common = max(set(steps[0]) & set(steps[1]))
    assert steps[0][common] > steps[1][common], f"time balancing gave the fast island more steps: {steps}"
    relaunched = time.time()
    rounds0, _, text = _resumed(tmp_path / "resumed", first, tmp_path / "logs", *balanced)
    back = re.findall(r"resuming from round (\d+), the last round every island has", text)
    assert len(set(back)) == 1 and int(back[0]) >= 2, text[-3000:]
    assert min(rounds0) == int(back[0]) + 1, "the resumed run goes on from the round it resumed"
    first_round = (tmp_path / "resumed" / f"island0_round{min(rounds0)}.pt").stat().st_mtime
    print(f"islands ended {ended:.1f} s after the coordinator was lost; relaunched, they resumed from round "
          f"{back[0]} and finished their first round {first_round - relaunched:.1f} s after the launch")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="mounting a tmpfs needs root")
def test_a_full_disk_during_a_save_loses_nothing_and_the_restarted_island_resumes(tmp_path):
    """Island 1 keeps its round checkpoints on a small tmpfs, filled up once round 2 is saved: its
    next save fails with ENOSPC, named with what is intact and the fix, and the partial write is
    removed. Space freed, torchrun restarts it; it resumes from its last round checkpoint (whole)
    and rejoins island 0, which trained on; from its first round back their states are equal."""
    first, logs = tmp_path / "first", tmp_path / "logs"
    disk, freed = first / "rounds_island1", first / "disk_freed"
    disk.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], check=True)
    failed = "the partial write was removed and the earlier checkpoints are intact"
    try:
        def fill_then_free() -> None:  # events only: round 2 saved, then the failure in island 1's log
            deadline = time.monotonic() + 300
            while not (disk / "round000002.ckpt").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            with suppress(OSError), open(disk / ".filler", "wb") as f:
                while True:
                    f.write(bytes(1 << 16))
                    f.flush()
            log = logs / "island1.log"
            while not (log.exists() and failed in log.read_text()) and time.monotonic() < deadline:
                time.sleep(0.05)
            (disk / ".filler").unlink()
            freed.touch()

        helper = threading.Thread(target=fill_then_free, daemon=True)
        helper.start()
        cmd = [sys.executable, str(SCRIPTS / "islands_regression.py"), "--out", str(first), "--steps", "48", "--H",
               "4", "--delays", "0.05", "--round-ckpt-every", "1", "--keep-rounds", "3", "--hold-for-rejoin", "28",
               "--rejoiner", "1", "--restart-waits-for", str(freed), "--grace-s", "3", "--deadline-s", "60"]
        results = run_islands([1, 1], cmd, log_dir=logs, max_restarts=1, out=io.StringIO(),
                              env={"OMP_NUM_THREADS": "1"})
        helper.join(timeout=60)
        log = (logs / "island1.log").read_text()
        assert [r.returncode for r in results] == [0, 0], log[-4000:]
        assert "no space left on the device of" in log and failed in log, log[-4000:]
        back = re.search(r"island 1 resumes from its round (\d+) checkpoint", log)
        assert back and int(back.group(1)) >= 2, log[-4000:]
        assert sorted(p.name for p in disk.iterdir() if not p.name.startswith("round")) == []
        rounds0, rounds1 = load_rounds(first, 0), load_rounds(first, 1)
        restarted = sorted(r for r, saved in rounds1.items() if saved["restarted"])
        assert restarted and restarted[-1] == max(rounds0), f"island 1 was back for rounds {restarted}"
        for r in restarted:
            assert rounds0[r]["digest"] == rounds1[r]["digest"], f"round {r}"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# Two runs of four islands over a shaped link, each losing two islands: the first among four islands,
# the second among the three left. One run stops island 1 in its inner steps (SIGSTOP: alive, silent)
# and kills island 3 in an exchange (SIGKILL: a reset); the other cuts the middle island 1 in an
# exchange and island 3 in its inner steps (veth down: no reset, no packets). Every position and
# phase of a silent island: tests/test_membership.py; every kind x count x phase: benchmarks/stalls.py.
FAULTS = {
    "STOP+KILL": ["1:inner:6:STOP", "3:exchange:5:KILL"],
    "LINKDOWN": ["1:exchange:2:LINKDOWN", "3:inner:22:LINKDOWN"],
}
VERBS = {"KILL": "killing", "STOP": "stopping", "LINKDOWN": "cutting"}


@pytest.mark.parametrize("kind", list(FAULTS))
def test_islands_that_fall_in_either_phase_are_given_up_and_the_survivors_finish(tmp_path, kind):
    """Four islands; islands 1 and 3 fall, one in its inner steps and one in an exchange, by
    SIGKILL (a TCP reset; torchrun restarts the island and it rejoins or finds the run over),
    SIGSTOP (alive and silent, its sockets open) or its veth taken down (no reset, no packets).
    Each fault is seen to happen. Islands 0 and 2 give each fallen island up within the grace
    window, stall at most the grace window plus one transfer, finish every round, and end with
    bit-identical global state (as does a restarted island from its first round back)."""
    from lightning_islands.app import netns

    link = [] if netns.link_problem() is not None else ["--link", "200mbit"]  # netns: root, ip, tc
    if kind == "LINKDOWN" and not link:
        pytest.skip(netns.link_problem())
    falls = {int(f.split(":")[0]): f.split(":")[3] for f in FAULTS[kind]}  # island -> how it falls
    out, grace, deadline = tmp_path / kind.lower(), 3.0, 120.0  # gloo's own timeout would stall them 240 s
    faults = [arg for fault in FAULTS[kind] for arg in ("--fault", fault)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_islands.app.cli", "run", "--islands", "1,1,1,1", "--live", "off",
         "--max-restarts", "1" if "KILL" in falls.values() else "0", *link, "--", sys.executable,
         str(SCRIPTS / "islands_regression.py"), "--out", str(out), "--steps", "32", "--H", "4", "--batch-sizes",
         "4,8,6,5", "--grace-s", str(grace), "--deadline-s", str(deadline), *faults],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        until = time.monotonic() + 480
        while not ((out / "island0_done").exists() and (out / "island2_done").exists()) and proc.poll() is None:
            assert time.monotonic() < until, "the survivors did not finish"
            time.sleep(0.2)
        for i, how in falls.items():
            if how == "KILL":
                continue
            pid = int((out / f"pid_island{i}").read_text())
            stat = Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()
            if how == "STOP":
                assert stat[0] == "T", f"island {i} is stopped, not gone"
            kill_island_process(pid)  # stopped or cut off, it would never end by itself
        text = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    for i, how in falls.items():
        assert f"{VERBS[how]} island {i}" in text, text[-4000:]
    # once each (the failure report after the run quotes an island's last lines again, indented)
    downs = re.findall(r"^\[island \d\] cutting island \d's link .* is down$", text, re.MULTILINE)
    assert len(downs) == list(falls.values()).count("LINKDOWN"), text[-4000:]
    # each fallen island was given up (left out of a round's members, or named as lost in an exchange) or,
    # killed, replaced by its restart, which rejoined
    for i, before, after in [(1, r"0, 1, 2, 3", r"0, 2, 3"), (3, r"0, (1, )?2, 3", r"0, (1, )?2")]:
        gone = rf"members \[{before}\] -> \[{after}\]|islands \[{i}\] were lost|island {i} rejoins the run at round"
        assert re.search(gone, text), f"island {i} was given up: " + text[-4000:]
    rounds0, rounds2 = load_rounds(out, 0), load_rounds(out, 2)
    assert sorted(rounds0) == sorted(rounds2) == list(range(1, 9)), text[-4000:]
    for r in rounds0:
        assert rounds0[r]["digest"] == rounds2[r]["digest"], f"round {r}"
    for i in (1, 3):
        for r, saved in load_rounds(out, i).items():
            if saved["restarted"]:
                assert saved["digest"] == rounds0[r]["digest"], f"island {i} back in round {r}"
    times = sorted(p.stat().st_mtime for p in out.glob("island0_round*.pt"))
    stall = max(b - a for a, b in zip(times, times[1:]))
    print(f"{kind}, 4 islands: island 0's longest stall between rounds {stall:.1f} s (grace {grace:g} s)")
    assert stall < grace + 10.0 < deadline, f"island 0 stalled {stall:.1f} s between rounds (grace {grace:g} s)"


def test_a_killed_butterfly_island_restarts_and_mixes_with_its_partners_again(tmp_path):
    """Four butterfly islands; island 1's process is SIGKILLed in its inner steps of round 3 and
    torchrun restarts it (--max-restarts). The others go on, island 1's partners mixing alone; they
    pause after step 22 until island 1 is back or asked to rejoin (an event, see HoldForRejoin).
    From its first round back, island 1 ends each stage bit-identical with that stage's partner
    (island 0 at stage 0, island 3 at stage 1), and every other island trains through every round."""
    out = tmp_path / "bfly-kill"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_islands.app.cli", "run", "--islands", "1,1,1,1", "--live", "off",
         "--max-restarts", "1", "--", sys.executable, str(SCRIPTS / "islands_regression.py"), "--out", str(out),
         "--steps", "32", "--H", "4", "--batch-sizes", "4,8,6,5", "--grace-s", "3", "--deadline-s", "60",
         "--topology", "butterfly", "--codec", "int4", "--kill-island", "1", "--kill-phase", "inner",
         "--kill-step", "10", "--kill-round", "3", "--hold-for-rejoin", "22"],
        capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "killing island 1" in text and "island 1 rejoins the run at round" in text, text[-4000:]
    rounds = {i: load_rounds(out, i) for i in range(4)}
    assert all(sorted(rounds[i]) == list(range(1, 9)) for i in (0, 2, 3)), text[-4000:]
    back = sorted(r for r, saved in rounds[1].items() if saved["restarted"])
    assert back and back[0] <= 22 // 4 + 2 and back[-1] == 8, f"island 1 was back for rounds {back}"
    for r in back:
        partner = 0 if r % 2 else 3  # stage 0 (odd rounds) pairs islands 0 and 1, stage 1 islands 1 and 3
        for name, t in rounds[partner][r]["params"].items():
            assert torch.equal(t, rounds[1][r]["params"][name]), f"round {r}: {name} differs from island {partner}"
        # island 2 is never island 1's partner: the pairs hold models of their own
        assert not all(torch.equal(t, rounds[2][r]["params"][n]) for n, t in rounds[1][r]["params"].items()), r


def test_a_stopped_island_in_a_butterfly_leaves_its_partners_mixing_alone(tmp_path):
    """Four butterfly islands; island 1 is stopped (SIGSTOP: alive, silent) in its inner steps of round
    2. Its partners (island 3 at stage 1, island 0 at stage 0) treat their stage as the identity
    within the grace window and every other island finishes every round, pairs still bit-identical."""
    out, grace = tmp_path / "bfly", 3.0
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_islands.app.cli", "run", "--islands", "1,1,1,1", "--live", "off", "--",
         sys.executable, str(SCRIPTS / "islands_regression.py"), "--out", str(out), "--steps", "16", "--H", "4",
         "--batch-sizes", "4,8,6,5", "--grace-s", str(grace), "--deadline-s", "120", "--topology", "butterfly",
         "--codec", "int4", "--fault", "1:inner:6:STOP"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        until = time.monotonic() + 300
        while not all((out / f"island{i}_done").exists() for i in (0, 2, 3)) and proc.poll() is None:
            assert time.monotonic() < until, "the survivors did not finish"
            time.sleep(0.2)
        pid = int((out / "pid_island1").read_text())
        assert Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0] == "T", "island 1 is stopped"
        kill_island_process(pid)
        text = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopping island 1" in text, text[-4000:]
    rounds = {i: load_rounds(out, i) for i in (0, 2, 3)}
    assert all(sorted(r) == [1, 2, 3, 4] for r in rounds.values()), text[-4000:]
    def same(a: int, b: int, r: int) -> bool:  # the global models (each island's momentum is its own)
        return all(torch.equal(t, rounds[b][r]["params"][n]) for n, t in rounds[a][r]["params"].items())

    for r in (2, 4):  # stage 1: islands 0 and 2 together, island 3 without its partner
        assert same(0, 2, r) and not same(2, 3, r), f"round {r}"
        assert rounds[3][r]["metrics"]["islands/group_size"] == 1.0
    assert same(2, 3, 3) and not same(0, 2, 3)  # stage 0: islands 2 and 3; island 0 alone
    assert rounds[0][3]["metrics"]["islands/group_size"] == 1.0
    times = sorted(p.stat().st_mtime for p in out.glob("island0_round*.pt"))
    assert max(b - a for a, b in zip(times, times[1:])) < grace + 10.0

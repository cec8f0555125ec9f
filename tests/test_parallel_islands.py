"""Islands that parallelize differently (tensor parallel, expert parallel, FSDP2) train one model:
real processes, the provided MoE, its own parallel plan."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from conftest import SharedLaunches, launch, load_rounds

from lightning_islands.fsdp import FSDP2Strategy


def _islands_equal(out, rounds):
    a, b = load_rounds(out, 0), load_rounds(out, 1)
    assert sorted(a) == sorted(b) == list(range(1, rounds + 1))
    for r in a:
        for name, t in a[r]["params"].items():
            assert torch.equal(t, b[r]["params"][name]), f"round {r}: {name} differs between islands"
        assert a[r]["digest"] == b[r]["digest"]
    return a


# The islands of each layout: island 0 parallelizes as named, island 1 is one process of plain FSDP2.
LAYOUTS = {
    "tensor": ([2, 1], ["--tp", "2,1", "--batch-sizes", "8"]),
    "expert": ([2, 1], ["--ep", "2,1", "--batch-sizes", "4,8"]),
    "2d-mesh": ([4, 1], ["--tp", "2,1", "--batch-sizes", "4,8"]),
}
# The layouts whose run also checkpoints after step 4 (a round's end): the uninterrupted run that
# test_a_parallel_island_resumes_from_its_checkpoint_exactly resumes from and compares against.
CHECKPOINTED = {"tensor", "expert"}


def _resumed(layout):
    """The arguments of the run that resumes the layout's run from its step-4 checkpoints."""
    islands, args = LAYOUTS[layout]
    return islands, lambda run: ["--steps", 8, "--H", 4, *args,
                                 "--resume", str(run(layout) / "ckpt_island{island}" / "step=4.ckpt")]


# Every run of mixed_parallel.py the tests below read: name: (islands, arguments, or a function of
# ``layout_run`` that gives them once the runs they need exist). Each layout runs 8 steps, H=4.
RUNS = {
    **{layout: (islands, ["--steps", 8, "--H", 4, *args, *(["--ckpt-every", 4] if layout in CHECKPOINTED else [])])
       for layout, (islands, args) in LAYOUTS.items()},
    "one": ([1, 1], ["--batch-sizes", "8"]),  # two one-process islands, the tensor layout's data and start
    "tensor-resumed": _resumed("tensor"),
    "expert-resumed": _resumed("expert"),
    # a tensor-parallel island beside an FSDP2 island of two processes: two slices, both ways
    **{f"tensor-{way}": ([2, 2], ["--steps", 8, "--H", 4, "--tp", "2,1", "--batch-sizes", "8,4", "--codec", "int4",
                                  "--exchange", way]) for way in ("sliced", "leader")},
}
# launched a group at a time: two launches at once take less time than one after the other (much of a
# launch waits, see conftest.launch_together); more at once starve islands on 2 cores
GROUPS = [("tensor", "expert"), ("2d-mesh", "one"), ("tensor-resumed", "expert-resumed"),
          ("tensor-sliced", "tensor-leader")]


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory):
    """``layout_run(name)``: the output folder of RUNS[name], launched the first time a test asks for
    it together with the rest of its group and shared by every test of the module that reads it
    (conftest.SharedLaunches). A failed launch fails every test that asks for it."""

    def job(name: str, run: SharedLaunches):
        islands, args = RUNS[name]
        args = args(run) if callable(args) else args  # the runs it resumes from, first
        base = tmp_path_factory.mktemp(name)
        return (islands, ["mixed_parallel.py", "--out", base / "run", *args], base / "logs"), {}, base / "run"

    return SharedLaunches(GROUPS, job)


@pytest.mark.parametrize("layout, meshes", [
    ("tensor", [{"dp": 1, "tp": 2, "ep": 1}, {"dp": 1, "tp": 1, "ep": 1}]),
    ("expert", [{"dp": 2, "tp": 1, "ep": 2}, {"dp": 1, "tp": 1, "ep": 1}]),
    ("2d-mesh", [{"dp": 2, "tp": 2, "ep": 1}, {"dp": 1, "tp": 1, "ep": 1}]),
], ids=["tensor-vs-fsdp", "expert-vs-fsdp", "2d-mesh-vs-fsdp"])
def test_islands_that_parallelize_differently_keep_one_global_state(layout_run, layout, meshes):
    out = layout_run(layout)
    rounds = _islands_equal(out, 2)
    records = [json.loads((out / f"island{i}_mesh.json").read_text()) for i in range(2)]
    assert [r["mesh"] for r in records] == meshes
    if meshes[0]["tp"] > 1:  # FSDP2 over tensor parallel on island 0, plain FSDP2 on island 1
        assert records[0]["placements"]["model.blocks.0.attn.wq.weight"] == ["_S(0, 2)", "S(0)"]
        assert records[0]["placements"]["model.blocks.0.attn.proj.weight"] == ["S(0)", "S(1)"]
        assert records[1]["placements"]["model.blocks.0.attn.wq.weight"] == ["S(0)"]
    assert rounds[2]["metrics"]["islands/islands_present"] == 2
    # the island's tokens of a round: 4 steps of 8 windows of 16 tokens (tensor-parallel ranks count once)
    assert rounds[2]["metrics"]["islands/round_tokens"] == load_rounds(out, 1)[2]["metrics"][
        "islands/round_tokens"] == 4 * 8 * 16
    # every expert of the parallelized island received gradient
    grads = records[0]["expert_grads"]
    assert len(grads) == 2 * 3 * 4 and all(g > 0 for g in grads.values()), grads


def test_a_tensor_parallel_island_exchanges_by_slices_as_its_leader_would(layout_run):
    """exchange=sliced between a tensor-parallel island (tp=2) and an FSDP2 island of two processes:
    the canonical vector is cut into two slices, and each rank of each island owns one, though the
    TP island's shards (head rows and columns) are laid out nothing like the FSDP island's (row
    blocks). The islands stay bit-identical, and equal to the leader's path bit for bit (int4)."""
    sliced, leader = _islands_equal(layout_run("tensor-sliced"), 2), _islands_equal(layout_run("tensor-leader"), 2)
    for r in (1, 2):
        assert sliced[r]["metrics"]["islands/exchange_chunks"] == 2, "two slices, one per rank"
        assert leader[r]["metrics"]["islands/exchange_chunks"] == 1, "the leader's one chunk"
        assert sliced[r]["digest"] == leader[r]["digest"]
        for name, t in leader[r]["params"].items():
            assert torch.equal(sliced[r]["params"][name], t), (r, name)
    records = [json.loads((layout_run("tensor-sliced") / f"island{i}_mesh.json").read_text()) for i in range(2)]
    assert [r["mesh"]["tp"] for r in records] == [2, 1] and records[1]["mesh"]["dp"] == 2


def test_a_tensor_parallel_island_trains_what_one_process_would(layout_run):
    """The tensor-parallel run against two one-process islands (both shared, see layout_run)."""
    tp, one = layout_run("tensor"), layout_run("one")
    a, b = load_rounds(tp, 0), load_rounds(one, 0)
    for name, t in b[2]["params"].items():  # the same data and start; only the order of sums differs
        torch.testing.assert_close(a[2]["params"][name], t, rtol=1e-4, atol=1e-5, msg=name)
    assert a[2]["metrics"]["islands/round_tokens"] == b[2]["metrics"]["islands/round_tokens"]


@pytest.mark.parametrize("layout", ["tensor", "expert"])
def test_a_parallel_island_resumes_from_its_checkpoint_exactly(layout_run, layout):
    """The layout's shared run (8 steps, a checkpoint after step 4) is the uninterrupted one; a second
    launch (shared too) resumes from its step-4 checkpoints and must reach the same rounds bit for bit."""
    full, resumed = layout_run(layout), layout_run(f"{layout}-resumed")
    a, b = load_rounds(full, 0), load_rounds(resumed, 0)
    # the checkpoint after step 4 holds the batch that closes round 1: the resumed fit runs rounds 1 and 2
    assert sorted(b) == [1, 2]
    for r in (1, 2):
        for name, t in a[r]["params"].items():
            assert torch.equal(t, b[r]["params"][name]), (r, name)
        assert a[r]["digest"] == b[r]["digest"] == load_rounds(resumed, 1)[r]["digest"]


def test_a_mismatched_model_is_still_refused_across_layouts(tmp_path):
    results, text = launch([2, 1], ["mixed_parallel.py", "--out", tmp_path, "--tp", "2,1", "--experts", "4,8"],
                           tmp_path / "logs", expect_ok=False)
    assert all(r.returncode != 0 for r in results)
    assert "islands disagree before the first step" in text and "island 1 has parameters=" in text


class _Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_bad_parallel_sizes_are_named_with_the_fix():
    with pytest.raises(ValueError, match="not supported together"):
        FSDP2Strategy(tensor_parallel_size=2, expert_parallel_size=2)
    with pytest.raises(ValueError, match="at least 1"):
        FSDP2Strategy(tensor_parallel_size=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(tensor_parallel_size=2), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the 1 processes"):
        trainer.fit(_Plain())

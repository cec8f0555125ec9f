"""``lightning-islands export``: a real run's global model as one file, loaded back without this
package's checkpoint code, and bad input refused with its cause and fix (exit code 2)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_DATA, TINY_MODEL, run_dir_of, train
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_islands.app import cli
from lightning_islands.app.export import export

# Two one-process islands, 4 steps in two rounds of H=2; last.ckpt after step 3 (inside round 2:
# the island's own parameters differ from the global ones there), round000002.ckpt at the end.
RUN = [*TINY_MODEL, *TINY_DATA, "islands=two_equal", "islands.sync_every=2", "trainer.max_steps=4",
       "trainer.val_check_interval=4", "trainer.checkpoint_every_n_steps=3", "trainer.checkpoint_every_n_rounds=2",
       "+trainer.num_sanity_val_steps=0", "logger=none"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, app_env) -> Path:
    """The folder of one finished two-island run."""
    return run_dir_of(train(RUN, tmp_path_factory.mktemp("export_run"), app_env))


def _torch_read(folder: Path, tmp: Path) -> dict:
    """A distributed checkpoint folder as torch itself converts it (its own reader, not ours)."""
    out = tmp / f"{folder.parent.parent.name}_{folder.parent.name}_{folder.name}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=True)


def _global_model(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The global parameters an island's checkpoint holds (its anchors), by the module's state-dict
    names (the tied output projection is the embedding)."""
    anchors = _torch_read(checkpoint / "islands_outer", tmp)["anchor"]
    return {**anchors, "model.lm_head.weight": anchors["model.tok_emb.weight"]}


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def _fresh_model(config: Path) -> torch.nn.Module:
    return instantiate(OmegaConf.load(config))


def _loss(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def test_the_export_loads_into_a_fresh_model_as_the_global_model(run, tmp_path, capsys):
    assert cli.main(["export", str(run), "--out", str(tmp_path / "model.safetensors")]) == 0
    line = capsys.readouterr().out
    final = run / "island0" / "checkpoints" / "final.ckpt"
    assert f"from the global parameters of {final}" in line and "parameters," in line, line
    assert export(run, tmp_path / "model.pt").parameters == 246_592  # tied embedding counted once

    loaded = {"safetensors": load_file(tmp_path / "model.safetensors"),
              "pt": torch.load(tmp_path / "model.pt", weights_only=True)}
    expected = _global_model(final, tmp_path)
    # after training every island's own parameters are the global ones: the module's state dict too
    assert _same_bits(expected, _torch_read(final, tmp_path)["state_dict"])
    for name, state in loaded.items():
        assert _same_bits(state, expected), name
        model = _fresh_model(tmp_path / "model.yaml")
        model.load_state_dict(state, strict=True)
        assert _same_bits(model.state_dict(), expected), name
        assert torch.isfinite(_loss(model)), name
    assert OmegaConf.load(tmp_path / "model.yaml") == OmegaConf.load(run / "job.yaml").model


def test_every_island_exports_the_same_bits(run, tmp_path):
    for island in (0, 1):
        export(run, tmp_path / f"island{island}.safetensors", island=island)
    assert _same_bits(load_file(tmp_path / "island0.safetensors"), load_file(tmp_path / "island1.safetensors"))


def test_last_and_round_checkpoints_export_their_global_model(run, tmp_path):
    last = run / "island1" / "checkpoints" / "last.ckpt"
    done = export(run, tmp_path / "last.safetensors", island=1, checkpoint="last")
    assert done.checkpoint == last and done.global_parameters
    exported, expected = load_file(tmp_path / "last.safetensors"), _global_model(last, tmp_path)
    assert _same_bits(exported, expected)
    local = _torch_read(last, tmp_path)["state_dict"]  # step 3, inside round 2: the island's own parameters
    assert not _same_bits(local, expected), "the test needs a checkpoint where local and global differ"

    export(run, tmp_path / "round.pt", checkpoint="round000002.ckpt")  # a name in the island's folder
    export(run, tmp_path / "final.pt")
    assert _same_bits(torch.load(tmp_path / "round.pt", weights_only=True),
                      torch.load(tmp_path / "final.pt", weights_only=True))


def _copy_job(run: Path, to: Path, **changes) -> Path:
    (to / "island0" / "checkpoints").mkdir(parents=True)
    job = OmegaConf.load(run / "job.yaml")
    for key, value in changes.items():
        OmegaConf.update(job, key, value)
    OmegaConf.save(job, to / "job.yaml")
    return to / "island0" / "checkpoints"


def test_a_checkpoint_whose_save_was_cut_short_is_found(run, tmp_path):
    """The save of final.ckpt stopped between its renames: only final.ckpt.previous is there."""
    folder = _copy_job(run, tmp_path / "run")
    shutil.copytree(run / "island0" / "checkpoints" / "final.ckpt", folder / "final.ckpt.previous")
    done = export(tmp_path / "run", tmp_path / "model.safetensors")
    assert done.checkpoint == folder / "final.ckpt.previous"
    export(run, tmp_path / "reference.safetensors")
    assert _same_bits(load_file(tmp_path / "model.safetensors"), load_file(tmp_path / "reference.safetensors"))


def test_a_one_file_checkpoint_exports_its_state_dict(run, tmp_path):
    """``single`` and ``ddp`` runs write one file, a pickled dict whose ``state_dict`` is the module's."""
    export(run, tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    folder = _copy_job(run, tmp_path / "run", **{"strategy.name": "single"})
    torch.save({"epoch": 0, "global_step": 4, "state_dict": state, "optimizer_states": []}, folder / "final.ckpt")
    done = export(tmp_path / "run", tmp_path / "again.safetensors")
    assert not done.global_parameters and done.checkpoint == folder / "final.ckpt"
    assert _same_bits(load_file(tmp_path / "again.safetensors"), state)


def _no_checkpoint(run: Path, tmp: Path) -> list[str]:
    _copy_job(run, tmp / "run")
    return [str(tmp / "run"), "--out", str(tmp / "m.pt")]


def _single_world(run: Path, tmp: Path) -> list[str]:
    _copy_job(run, tmp / "run", **{"strategy.name": "single"})
    return [str(tmp / "run"), "--out", str(tmp / "m.pt")]


def _crafted_metadata(run: Path, tmp: Path) -> list[str]:
    folder = _copy_job(run, tmp / "run")
    shutil.copytree(run / "island0" / "checkpoints" / "final.ckpt", folder / "final.ckpt")
    (folder / "final.ckpt" / ".metadata").write_bytes(b"cos\nsystem\n(S'true'\ntR.")  # os.system('true')
    return [str(tmp / "run"), "--out", str(tmp / "m.pt")]


def _other_model(run: Path, tmp: Path) -> list[str]:
    folder = _copy_job(run, tmp / "run", **{"model.d_model": 32})
    shutil.copytree(run / "island0" / "checkpoints" / "final.ckpt", folder / "final.ckpt")
    return [str(tmp / "run"), "--out", str(tmp / "m.pt")]


BAD = {  # name: (argv from (run, tmp), what stderr says, {run} the run's folder: the cause and the fix)
    "no job.yaml": (lambda run, tmp: [str(tmp), "--out", str(tmp / "m.pt")],
                    ["has no job.yaml", "give a run's folder"]),
    "a multirun's folder": (lambda run, tmp: [str(run.parent), "--out", str(tmp / "m.pt")],
                            ["has no job.yaml", "its subfolders {run} are runs"]),
    "no checkpoint": (_no_checkpoint, ["has no final.ckpt or last.ckpt", "the run ended before it wrote one"]),
    "no such checkpoint": (lambda run, tmp: [str(run), "--out", str(tmp / "m.pt"), "--checkpoint", "round9.ckpt"],
                           ["there is no checkpoint at", "give final, last or the path"]),
    "a folder of rounds": (lambda run, tmp: [str(run), "--out", str(tmp / "m.pt"), "--checkpoint",
                                             str(run / "island0" / "checkpoints")],
                           ["is a folder of round checkpoints", "--checkpoint {run}/island0/checkpoints/round000002"]),
    "another suffix": (lambda run, tmp: [str(run), "--out", str(tmp / "m.bin")],
                       [".bin is not a format", "end the name with .safetensors", "or .pt"]),
    "a folder that does not exist": (lambda run, tmp: [str(run), "--out", str(tmp / "nope" / "m.pt")],
                                     ["does not exist", "mkdir -p"]),
    "a folder as --out": (lambda run, tmp: [str(run), "--out", str(tmp / "d.pt")],
                          ["is a folder", "give a file name"]),
    "island out of range": (lambda run, tmp: [str(run), "--out", str(tmp / "m.pt"), "--island", "2"],
                            ["--island 2", "has 2 islands", "give --island from 0 to 1"]),
    "negative island": (lambda run, tmp: [str(run), "--out", str(tmp / "m.pt"), "--island", "-1"],
                        ["--island -1", "give --island from 0 to 1"]),
    "island of a single world": (lambda run, tmp: [*_single_world(run, tmp), "--island", "1"],
                                 ["--island 1", "has one island", "give --island 0 or leave it out"]),
    "metadata that runs code": (_crafted_metadata, ["os.system is not part of a checkpoint's metadata",
                                                    "could run code"]),
    "another model": (_other_model, ["does not hold the model", "shaped otherwise", "export a checkpoint of this run"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_with_the_cause_and_the_fix(run, tmp_path, capsys, case):
    (tmp_path / "d.pt").mkdir()
    argv, says = BAD[case]
    assert cli.main(["export", *argv(run, tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-islands export: ") and "Traceback" not in err, err
    for text in says:
        assert text.format(run=run) in err, (text, err)
    assert not list(tmp_path.glob("m.*")), "nothing written"


def test_the_snippet_of_docs_export_loads_the_file(run, tmp_path, monkeypatch):
    export(run, tmp_path / "model.safetensors")
    text = (Path(__file__).parents[1] / "docs" / "EXPORT.md").read_text()
    snippet = text.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(snippet, scope)  # noqa: S102 - the documentation's own example
    assert _same_bits(scope["model"].state_dict(), load_file(tmp_path / "model.safetensors"))
    assert torch.isfinite(_loss(scope["model"]))


def test_the_usage_names_export():
    assert "export RUN_DIR --out FILE" in cli.USAGE

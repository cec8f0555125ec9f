"""Checkpoints reach disk whole and durably, are found again after a crash at any point of a save,
are kept by round, and are read without running code (lightning_islands.engine.saves and
safe_metadata). The crashes are real: a process SIGKILLs itself at each point of a save."""

from __future__ import annotations

import errno
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_islands.engine import saves
from lightning_islands.engine.safe_metadata import check_metadata
from lightning_islands.engine.saves import (
    drop_rounds_after,
    explain_unreadable,
    explain_unwritable,
    is_round_folder,
    previous_path,
    prune_rounds,
    publish,
    recover,
    round_checkpoints,
    round_path,
    staged_path,
)

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_0.1.0"


def _checkpoint(path: Path, text: str) -> None:
    path.mkdir(parents=True)
    (path / "shard").write_text(text)
    (path / "meta").write_text(text)


def _content(path: Path) -> str:
    shard, meta = (path / "shard").read_text(), (path / "meta").read_text()
    assert shard == meta, f"{path} is torn: {shard!r} / {meta!r}"
    return shard


def test_a_checkpoint_is_published_whole_or_not_at_all(tmp_path):
    final = tmp_path / "last.ckpt"
    _checkpoint(final, "round 1")
    staged = staged_path(final)
    _checkpoint(staged, "round 2")
    publish(staged, final)
    assert _content(final) == "round 2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    # a crash between the two renames: the message points to the checkpoint set aside
    (tmp_path / "last.ckpt.previous").mkdir()
    message = explain_unreadable(final, ValueError("bad shard"))
    assert str(final) in message and "last.ckpt.previous holds the checkpoint it replaced" in message
    assert "resume from an earlier checkpoint" in message


# every system call of a save after the staged write: the process dies just before the n-th one
_CRASH = """
import importlib.util, os, signal, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("saves", sys.argv[3])  # the module alone: no torch to import
saves = importlib.util.module_from_spec(spec)
spec.loader.exec_module(saves)
calls, at = [0], int(sys.argv[2])
def dying(real):
    def call(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return call
for name in ("rename", "fsync", "unlink", "rmdir"):
    setattr(os, name, dying(getattr(os, name)))
final = Path(sys.argv[1])
saves.publish(saves.staged_path(final), final)
print("published", calls[0])
"""


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_crash_at_any_point_of_a_save_leaves_a_complete_checkpoint_that_is_found(tmp_path, kind):
    """Kill the saving process before each system call of publish in turn (fsyncs, renames,
    removals): recover() then finds a complete checkpoint under the final name, the new one once
    the write was marked complete, else the old one, and leaves nothing else behind."""
    n, seen = 1, set()
    while True:
        folder = tmp_path / f"crash{n}"
        final = folder / "last.ckpt"
        if kind == "folder":
            _checkpoint(final, "old")
            _checkpoint(staged_path(final), "new")
        else:
            folder.mkdir()
            final.write_text("old")
            staged_path(final).write_text("new")
        proc = subprocess.run([sys.executable, "-c", _CRASH, str(final), str(n), saves.__file__],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            assert "published" in proc.stdout
            break
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        assert recover(final)
        seen.add(_content(final) if kind == "folder" else final.read_text())
        assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"], f"crash {n}: leftovers"
        n += 1
    assert n > 6, f"publish made only {n - 1} system calls"
    assert seen == {"old", "new"}, "crashes before the mark find the old one, after it the new one"


def test_a_write_cut_short_is_cleared_and_the_last_checkpoint_stays(tmp_path):
    final = tmp_path / "last.ckpt"
    _checkpoint(final, "old")
    staged_path(final).mkdir()
    (staged_path(final) / "shard").write_text("half")  # never marked complete
    assert recover(final) and _content(final) == "old"
    assert not staged_path(final).exists()
    missing = tmp_path / "never.ckpt"
    assert not recover(missing)


def test_round_checkpoints_are_listed_repaired_and_pruned(tmp_path):
    for r in (1, 2, 3):
        _checkpoint(round_path(tmp_path, r), f"round {r}")
    # round 4's save died between its renames (the round is new: nothing was set aside), round 5's mid-write
    _checkpoint(staged_path(round_path(tmp_path, 4)), "round 4")
    (staged_path(round_path(tmp_path, 4)) / ".complete").touch()
    _checkpoint(staged_path(round_path(tmp_path, 5)), "round 5, half")
    assert is_round_folder(tmp_path) and not is_round_folder(round_path(tmp_path, 1))
    assert sorted(round_checkpoints(tmp_path, repair=False)) == [1, 2, 3, 4]
    found = round_checkpoints(tmp_path)
    assert sorted(found) == [1, 2, 3, 4] and _content(found[4]) == "round 4"
    assert not staged_path(round_path(tmp_path, 5)).exists()
    kept = prune_rounds(tmp_path, keep=2)
    assert kept == [round_path(tmp_path, 3), round_path(tmp_path, 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round000003.ckpt", "round000004.ckpt"]
    # a round whose old copy was set aside when its save died between the renames
    round_path(tmp_path, 4).rename(previous_path(round_path(tmp_path, 4)))
    assert sorted(round_checkpoints(tmp_path)) == [3, 4] and _content(round_path(tmp_path, 4)) == "round 4"
    # a removal cut short leaves nothing under a round's name, and its leftovers are cleared
    (tmp_path / "round000002.ckpt.deleting").mkdir()
    assert sorted(round_checkpoints(tmp_path)) == [3, 4] and not (tmp_path / "round000002.ckpt.deleting").exists()
    # resumed from round 3, the abandoned run's later rounds go (the resumed run writes its own)
    assert drop_rounds_after(tmp_path, 3) == [4] and sorted(round_checkpoints(tmp_path)) == [3]


def test_a_full_disk_is_named_with_what_is_intact_and_the_fix(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    wrapped = CheckpointException("a rank failed", {0: (err, None)})  # how torch's distributed save reports it
    for e in (err, wrapped):
        message = explain_unwritable(tmp_path / "round000003.ckpt", e, [round_path(tmp_path, 2)])
        assert "no space left on the device of" in message and "MiB free" in message
        assert "round000002.ckpt" in message and "partial write was removed" in message and "free space" in message
    assert "fix the cause" in explain_unwritable(tmp_path / "x.ckpt", PermissionError("read-only"), [])


def test_checkpoint_metadata_that_could_run_code_is_refused(tmp_path):
    for folder in (FIXTURE / "island0.ckpt", FIXTURE / "island0.ckpt" / "islands_outer"):
        check_metadata(folder)  # what torch's distributed checkpoint writes passes

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match=r"\.metadata holds more than a checkpoint's metadata .*system"):
        check_metadata(tmp_path)

    def global_call(module: str, name: str, arg: str) -> bytes:  # protocol 4: module, then a (dotted) name
        def text(t: str) -> bytes:
            return pickle.SHORT_BINUNICODE + bytes([len(t)]) + t.encode()
        return (pickle.PROTO + b"\x04" + text(module) + text(name) + pickle.STACK_GLOBAL + text(arg)
                + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)

    # what torch's metadata module imports is not its metadata: reached by a dotted name, or by name
    for module, name in (("torch.distributed.checkpoint.metadata", "os.system"),
                         ("torch.distributed.checkpoint.planner", "torch.os.system"),
                         ("torch.distributed.checkpoint.metadata", "dataclass")):
        (tmp_path / ".metadata").write_bytes(global_call(module, name, f"touch {tmp_path / 'ran'}"))
        with pytest.raises(ValueError, match=rf"{module}\.{name} is not part of a checkpoint's metadata"):
            check_metadata(tmp_path)
    assert not (tmp_path / "ran").exists()

"""How a checkpoint reaches disk whole, durably, and is found again after any crash.

A checkpoint (a file or a folder) is written beside its final name (:func:`staged_path`), made
durable (every file and folder fsynced), marked complete, and only then moved into place; the one
it replaces is set aside (:func:`previous_path`) until the new one is in place. Whatever the moment
a process dies, :func:`recover` finds a complete checkpoint under the final name again: the staged
one if it was marked complete, else the one set aside.

Rounds: an island's round checkpoints live in one folder as ``round{r:06d}.ckpt``
(:func:`round_path`); :func:`round_checkpoints` lists them (recovering each first) and
:func:`prune_rounds` keeps the newest ``keep``.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

STAGED, PREVIOUS, COMPLETE, DELETING = ".partial", ".previous", ".complete", ".deleting"
_ROUND = re.compile(r"^round(\d{6,})\.ckpt$")


def discard(path: Path) -> None:
    """Remove the file or folder at ``path``, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def staged_path(final: Path) -> Path:
    """Where a checkpoint meant for ``final`` is written first."""
    return final.with_name(final.name + STAGED)


def previous_path(final: Path) -> Path:
    """Where the checkpoint at ``final`` is set aside while a new one moves in."""
    return final.with_name(final.name + PREVIOUS)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: Path) -> None:
    """fsync every file and folder under ``path`` (itself included), deepest first."""
    if path.is_dir():
        for folder, _dirs, files in os.walk(path, topdown=False):
            for name in files:
                _fsync(Path(folder, name))
            _fsync(Path(folder))
    else:
        _fsync(path)


def _marker(staged: Path) -> Path:
    return staged / COMPLETE if staged.is_dir() else staged.with_name(staged.name + COMPLETE)


def is_complete(staged: Path) -> bool:
    """Whether the staged write ``staged`` finished (it was marked complete by :func:`publish`)."""
    return staged.exists() and _marker(staged).exists()


def publish(staged: Path, final: Path) -> None:
    """Move a completely written checkpoint from ``staged`` to ``final``, durably.

    Its files are fsynced and it is marked complete; the previous checkpoint at ``final`` is set
    aside, the new one moved in, the folder fsynced, and only then the previous one removed. A crash
    at any point leaves a complete checkpoint that :func:`recover` puts back under ``final``."""
    sync_tree(staged)
    marker = _marker(staged)
    marker.touch()
    _fsync(marker)
    _fsync(marker.parent)
    folder, previous = final.parent, previous_path(final)
    discard(previous)
    if final.exists() or final.is_symlink():
        final.rename(previous)
    staged.rename(final)
    discard(_marker(staged))  # a file's marker lies beside it; a folder's moved in with it
    _fsync(folder)
    discard(previous)
    _fsync(folder)


def recover(final: Path) -> bool:
    """Put a complete checkpoint back under ``final`` after a crash during :func:`publish`, and
    remove what an interrupted write left; returns whether ``final`` holds a checkpoint now.

    A staged write marked complete is the newest checkpoint: it moves in. Otherwise ``final`` stays,
    or, missing, the one set aside moves back. One process at a time, never during a save."""
    staged, previous = staged_path(final), previous_path(final)
    changed = is_complete(staged) or not final.exists() and previous.exists()
    if is_complete(staged):
        discard(previous)
        if final.exists() or final.is_symlink():
            final.rename(previous)
        staged.rename(final)
    elif not final.exists() and previous.exists():
        previous.rename(final)
    if changed:
        _fsync(final.parent)  # the renames are durable before what they replace goes
    if final.exists():
        discard(previous)
    clear_staged(final)
    return final.exists()


def holder(final: Path) -> Path | None:
    """Where the checkpoint that :func:`recover` would put under ``final`` lies now (the staged
    write once complete, else ``final``, else the one set aside), without touching anything;
    ``None``: there is none."""
    staged, previous = staged_path(final), previous_path(final)
    return staged if is_complete(staged) else final if final.exists() else previous if previous.exists() else None


def clear_staged(final: Path) -> None:
    """Remove a staged write for ``final`` and its mark (before a new save, or an unfinished one)."""
    staged = staged_path(final)
    discard(staged)
    discard(_marker(staged))


def explain_unreadable(path: Path, err: BaseException) -> str:
    """A message for a checkpoint that could not be read: the path, the cause and the fix."""
    hints = [f"could not read the checkpoint {path} ({type(err).__name__}: {str(err)[:500]}); it is incomplete or "
             "damaged: resume from an earlier checkpoint"]
    for other, what in ((previous_path(path), "the checkpoint it replaced"),
                        (staged_path(path), "a write that did not finish")):
        if other.exists():
            hints.append(f"{other} holds {what}")
    return "; ".join(hints)


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or an error it wraps: a cause, or a rank's failure inside torch's
    ``CheckpointException``) is a full disk or quota."""
    todo, seen = [err], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        for failure in getattr(e, "failures", {}).values():  # (exception, stack) per rank
            todo += [x for x in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(x, BaseException)]
    return False


def explain_unwritable(final: Path, err: BaseException, kept: list[Path]) -> str:
    """A message for a checkpoint that could not be written: the cause, what is intact, the fix."""
    full = disk_full(err)
    cause = (f"no space left on the device of {final.parent} ({shutil.disk_usage(final.parent).free // 2**20} MiB "
             "free)" if full else f"{type(err).__name__}: {str(err)[:500]}")
    fix = ("free space there or write checkpoints elsewhere (ModelCheckpoint/RoundCheckpoint dirpath; in the app "
           "the run folder)" if full else "fix the cause")
    intact = ", ".join(str(p) for p in kept) or "none were written before"
    return (f"could not write the checkpoint {final} ({cause}); the partial write was removed and the earlier "
            f"checkpoints are intact ({intact}); {fix}, then resume from the last of them")


# ---------------------------------------------------------------------- checkpoints by round
def round_path(folder: Path, round_: int) -> Path:
    """Where an island keeps its checkpoint of round ``round_`` in ``folder``."""
    return folder / f"round{round_:06d}.ckpt"


def _named_rounds(folder: Path) -> set[int]:
    rounds = set()
    for entry in list(folder.iterdir()) if folder.is_dir() else []:
        if entry.name.endswith(DELETING):
            continue
        name = entry.name.removesuffix(COMPLETE).removesuffix(STAGED).removesuffix(PREVIOUS)
        m = _ROUND.match(name)
        if m:
            rounds.add(int(m.group(1)))
    return rounds


def round_checkpoints(folder: Path, repair: bool = True) -> dict[int, Path]:
    """The round checkpoints in ``folder`` by round, oldest first. ``repair``: first put back (or
    clear away) what a crash during a save left (:func:`recover`; only one process may do that)."""
    found = {}
    if repair:  # removals a crash cut short
        for entry in list(folder.glob(f"*{DELETING}")) if folder.is_dir() else []:
            discard(entry)
    for r in sorted(_named_rounds(folder)):
        path = round_path(folder, r)
        if recover(path) if repair else holder(path) is not None:
            found[r] = path
    return found


def is_round_folder(path: Path) -> bool:
    """Whether ``path`` is a folder of round checkpoints (rather than one checkpoint)."""
    return path.is_dir() and not _ROUND.match(path.name) and bool(_named_rounds(path))


def remove(path: Path) -> None:
    """Remove a checkpoint so that a crash midway never leaves a part of it under its name: it is
    renamed out of the way first (``round_checkpoints`` clears such leftovers)."""
    if path.exists():
        gone = path.with_name(path.name + DELETING)
        discard(gone)
        path.rename(gone)
        discard(gone)


def prune_rounds(folder: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` round checkpoints in ``folder``; returns those kept."""
    found = round_checkpoints(folder)
    rounds = sorted(found)
    for r in rounds[: max(0, len(rounds) - keep)]:
        remove(found[r])
    return [found[r] for r in rounds[-keep:]] if keep > 0 else []


def drop_rounds_after(folder: Path, round_: int) -> list[int]:
    """Remove the round checkpoints after ``round_`` (a run resumed from ``round_`` abandons them:
    its own rounds from there on differ); returns the rounds removed."""
    later = [r for r in round_checkpoints(folder) if r > round_]
    for r in later:
        remove(round_path(folder, r))
    return later

"""Before the first round: the islands meet, start from one state, and agree on where they start.

- :func:`meet`: the leader opens the link, the islands compare fingerprints of their model and
  settings through the coordinator (a mismatch is a clear error, not a hang), then open the lanes.
- :func:`adopt_initial_state`: every island takes island 0's parameters and buffers; the islands
  compare a SHA-256 first and send nothing when they already agree. With ``exchange=sliced``,
  :func:`adopt_initial_state_sliced` does it with no rank holding more than a chunk of its slice.
- :func:`agree_on_start` and :func:`settle_start`: at the start of every fit the islands compare a
  digest of their global state and whether each has steps left, and act on it alike.

Every function is a collective of the island (:meth:`Island.agree` carries the leader's result).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_islands.engine import saves
from lightning_islands.engine.island import Island
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.schedule import Schedule
from lightning_islands.engine.settings import compare_fingerprints
from lightning_islands.engine.slice_moves import chunk_parts, move_slices, slice_bounds
from lightning_islands.engine.state import OuterState
from lightning_islands.link.protocol import Link, RoundLost

RUN_RECORD = "run"  # where island 0 publishes the run's fingerprint and settings for islands that join later


def meet(island: Island, open_link: Callable[[], Link], fingerprint: dict[str, Any], rejoining: bool,
         joining: bool = False, settings: dict[str, Any] | None = None) -> None:
    """Leader: open the link, compare fingerprints through the coordinator, then open the lanes;
    every rank raises if any island differs. Island 0 publishes the run's record (its fingerprint
    and ``settings``) for islands that join later. ``rejoining``: a restarted island compares with
    what the others published when they started, whether or not they resumed, and opens no lanes
    (the round that takes it back builds them); ``joining``: a new island compares with the run's
    record instead (it knows no other island yet), and opens no lanes either."""

    def leader() -> None:
        try:
            island.link = open_link()
        except Exception as err:
            raise RuntimeError(f"could not meet the other islands: {err}") from err
        if joining:
            record = island.link.read_object(RUN_RECORD, fingerprint.get("deadline_s") or 3600.0)
            prints, islands = [record["fingerprint"], fingerprint], [0, island.index]  # type: ignore[index]
        else:
            prints, islands = island.link.gather_objects("fingerprint", fingerprint), None
            if island.index == 0 and not rejoining:
                island.link.publish(RUN_RECORD, {"fingerprint": fingerprint, "settings": settings})
        if rejoining or joining:
            prints = [{k: v for k, v in p.items() if k != "resuming"} for p in prints]
        error = compare_fingerprints(prints, islands)
        if error:
            raise RuntimeError(error)
        if not rejoining and not joining:
            island.link.open_lanes()

    island.agree(leader)


@torch.no_grad()
def adopt_initial_state(island: Island, layout: CanonicalLayout, state: OuterState, device: torch.device,
                        locals_: Sequence[Tensor], buffers: dict[str, Tensor], key: str) -> bool:
    """Every island takes island 0's parameters (into ``locals_``) and ``buffers``; the anchors are
    taken from them (fp32). ``key``: this exchange's own name at the coordinator. Returns whether
    island 0's state had to be sent.

    Islands first compare a SHA-256 of their full fp32 parameters and buffers: islands built from
    the same seed, or all loaded from the same plain checkpoint, already agree bit for bit, and then
    nothing is sent (a full fp32 copy less across the slow link).
    """
    mine = layout.gather_to_leader(locals_, device)
    if layout.has_copies:  # copies on several ranks (replicated under tensor parallel) may differ
        layout.scatter_from_leader(mine, device, into=list(locals_))  # every copy takes the one gathered
    found = island.with_link(lambda link: link.gather_objects(key, state_digest(mine, buffers)))
    if len(set(found)) == 1:
        state.set_anchors(locals_)
        return False
    if island.index == 0:
        island.on_leader(lambda link: link.broadcast_bytes(mine.cpu().view(torch.uint8), src=0))  # type: ignore
        state.set_anchors(locals_)
    else:
        flat = island.on_leader(lambda link: link.broadcast_bytes(None, src=0, limit=4 * layout.numel).view(
            torch.float32))
        shards = layout.scatter_from_leader(flat, device)
        # Anchors from the fp32 values received, not from parameters that may hold fewer bits.
        shards = [s.to(loc.device) for s, loc in zip(shards, locals_)]
        for loc, s in zip(locals_, shards):
            loc.copy_(s)
        state.set_anchors(shards)
    _share_buffers(island, buffers)
    return True


@torch.no_grad()
def adopt_initial_state_sliced(island: Island, layout: CanonicalLayout, state: OuterState, device: torch.device,
                               locals_: Sequence[Tensor], buffers: dict[str, Tensor], key: str,
                               lanes: Callable[[int], tuple[Any, tuple[str, str] | None]], chunk: int | None) -> bool:
    """:func:`adopt_initial_state` with ``exchange=sliced``: no rank gathers the model. The islands
    compare the checksum of their parameters that does not depend on how an island shards them
    (:meth:`CanonicalLayout.island_checksum`) and a SHA-256 of their buffers; the islands that
    differ from island 0 take its parameters slice by slice, rank to rank
    (:func:`~lightning_islands.engine.slice_moves.move_slices`, ``lanes(S)`` this rank's lanes for
    ``S`` slices, ``chunk`` values at a time), and every island takes its buffers. Returns whether
    island 0's state had to be sent."""
    if layout.has_copies:  # copies on several ranks (replicated under tensor parallel) may differ
        _copies_agree(layout, locals_, device, chunk)
    checksum = f"{layout.island_checksum(locals_):016x}"
    found = island.with_link(lambda link: link.gather_objects(key, {
        "digest": f"{checksum}/{state_digest(torch.empty(0), buffers)}", "ranks": layout.group.size}))
    takers = [i for i, d in enumerate(found) if d["digest"] != found[0]["digest"]]
    if not takers:
        state.set_anchors(locals_)
        return False
    slices = min(int(d["ranks"]) for d in found)
    link, failed = lanes(slices)
    try:
        taken = move_slices(island, layout, [locals_] if island.index == 0 else None, 1, locals_, 0, takers,
                            slices=slices, link=link, chunk=chunk, device=device, failed=failed,
                            what="island 0's parameters")
    except RoundLost as err:
        raise RuntimeError(f"island {island.index} could not take island 0's parameters at the start ({err}); start "
                           "the run again") from err
    if taken is None:
        state.set_anchors(locals_)
    else:  # anchors from the fp32 values received, not from parameters that may hold fewer bits
        for loc, t in zip(locals_, taken[0]):
            loc.copy_(t)
        state.set_anchors(taken[0])
    _share_buffers(island, buffers)
    return True


def _copies_agree(layout: CanonicalLayout, locals_: Sequence[Tensor], device: torch.device, chunk: int | None) -> None:
    """Every copy of a replicated parameter takes its owner's values, a chunk of each rank's slice
    at a time (a collective of the island, over its own fabric)."""
    idx = layout.copied()
    sub, held = layout.subset(idx), [locals_[i] for i in idx]
    for parts in chunk_parts(slice_bounds(sub.numel, layout.group.size, 1), chunk):
        sub.from_owners(sub.to_owners(held, parts, device), parts, device, held)


def _share_buffers(island: Island, buffers: dict[str, Tensor]) -> None:
    """Island 0 sends its buffers, the others load them (every island has the same module)."""
    if not buffers:
        return
    if island.index == 0:
        blob = io.BytesIO()
        torch.save({k: v.detach().cpu().clone() for k, v in buffers.items()}, blob)  # no view's whole storage
        payload = torch.frombuffer(bytearray(blob.getvalue()), dtype=torch.uint8)
        island.on_leader(lambda link: link.broadcast_bytes(payload, src=0))
        return
    # the same buffers as island 0's: their bytes, plus room for torch.save's framing
    limit = 2 * sum(b.numel() * b.element_size() for b in buffers.values()) + 2**20
    data = island.with_link(lambda link: link.broadcast_bytes(None, src=0, limit=limit).numpy().tobytes())
    received = torch.load(io.BytesIO(data), weights_only=True)
    for name, buf in buffers.items():
        if name in received:
            buf.copy_(received[name].to(buf.device))


def state_digest(flat: Tensor | None, buffers: dict[str, Tensor]) -> str:
    """SHA-256 of the full fp32 parameters (``flat``; empty: buffers only) and of every buffer
    (name, dtype, shape, bytes)."""
    assert flat is not None, "the leader holds the gathered parameters"
    h = hashlib.sha256(flat.cpu().numpy())
    for name, buf in buffers.items():
        h.update(f"{name}:{buf.dtype}:{tuple(buf.shape)}".encode())
        h.update(buf.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def agree_on_start(island: Island, digest: str | None, round_: int, more: bool, steps: int = 0,
                   max_staleness: int = 0) -> list[int]:
    """The islands' start agreement: every island's global state (``digest``, on the leader) must be
    the same; returns the islands that have no training steps left (``more=False``). With
    ``max_staleness`` an island whose outer step count (``steps``) is behind the furthest by at most
    that many may hold an older state (a late island's, checked against the others' recent states at
    its first round); the islands at the furthest count must agree."""

    def compare(link: Link) -> list[int]:
        found = link.gather_objects("start", {"digest": digest, "round": round_, "more": more, "steps": steps})
        furthest = max(int(d.get("steps", 0)) for d in found)
        compared = found
        if max_staleness and all(furthest - int(d.get("steps", 0)) <= max_staleness for d in found):
            compared = [d for d in found if int(d.get("steps", 0)) == furthest]
        if len({d["digest"] for d in compared}) != 1:
            raise RuntimeError(
                f"islands start from different global states (at rounds {[d['round'] for d in found]}); "
                "resume every island from its checkpoint of the same step, or none")
        return [i for i, d in enumerate(found) if not d["more"]]

    return island.with_link(compare)


def agree_on_resume(island: Island, rounds: list[int]) -> int:
    """The last round that every island has a checkpoint of (``rounds``: this island's), on every
    rank; none in common is a ``RuntimeError`` that lists each island's rounds and the fix."""

    def common(link: Link) -> int:
        found = link.gather_objects("resume_rounds", sorted(rounds))
        shared = set(found[0]).intersection(*found[1:])
        if not shared:
            listed = "; ".join(f"island {i}: {r or 'none'}" for i, r in enumerate(found))
            raise RuntimeError(f"no round has a checkpoint on every island ({listed}), so they cannot resume together; "
                               "keep more rounds (keep_round_checkpoints), or give each island a checkpoint of the "
                               "same round (resume=[...])")
        return max(shared)

    return island.with_link(common)


def checkpoint_to_load(island: Island, path: Path, agree: bool) -> tuple[Path, str | None]:
    """The checkpoint ``path`` names, after the leader repaired what a crash during its save left;
    for a folder of round checkpoints, the last round every island has (``agree``: the islands meet
    on it, and this island's later rounds, of the run abandoned there, are removed) or, not
    agreeing (alone, rejoining, not fitting), its own latest. Returns it and a line for the log."""
    def look() -> list[int] | None:
        if not saves.is_round_folder(path):
            saves.recover(path)
            return None
        return sorted(saves.round_checkpoints(path))

    rounds = island.agree(look)
    if rounds is None:
        return path, None
    if not rounds:
        raise FileNotFoundError(f"{path} holds no complete round checkpoint (only writes that did not finish); "
                                "resume from another checkpoint, or start afresh")
    if not agree:
        return saves.round_path(path, rounds[-1]), (f"islands: island {island.index} resumes from its round "
                                                    f"{rounds[-1]} checkpoint: {saves.round_path(path, rounds[-1])}")
    chosen = agree_on_resume(island, rounds)
    dropped = island.agree(lambda: saves.drop_rounds_after(path, chosen))
    return saves.round_path(path, chosen), (
        f"islands: resuming from round {chosen}, the last round every island has a checkpoint of (this island "
        f"has {rounds}): {saves.round_path(path, chosen)}" + (f"; its later rounds {dropped} were removed"
                                                              if dropped else ""))


def settle_start(schedule: Schedule, done: list[int]) -> tuple[bool, str | None, bool]:
    """Act on the start agreement (``done``: the islands without steps left). Returns whether to
    stop at once, and a message for the user (``None``: nothing to say) with whether it is a warning.

    Every island has steps: go on, also after the agreed end of an earlier run (a final checkpoint
    resumed with more steps). Some island has none: no round could complete (that island never
    joins one), so every island stops at once.
    """
    if not done:
        if not schedule.stopping:
            return False, None, False
        schedule.stopping = False
        return False, f"islands: continuing after round {schedule.round}, where the previous run ended", False
    if schedule.stopping:
        return True, (f"islands: this checkpoint is the agreed end of a run (round {schedule.round}) and not "
                      "every island has steps left; stopping. Raise trainer.max_steps to train further."), False
    schedule.stopping = True  # the end of training must not start a round the others never join
    return True, (f"islands: island(s) {done} have no steps left (trainer.max_steps reached), so no round can "
                  f"complete; not every island has steps left, stopping at round {schedule.round}. Give every "
                  "island a max_steps above the step it resumes from."), True

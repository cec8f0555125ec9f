"""One round's exchange, a chunk of the canonical vector at a time.

:func:`exchange_chunks` is the one chunk loop, for the synchronous round and the overlapped one
alike: for each chunk it takes the part (the synchronous round gathers it from the island's ranks,
an overlapped round slices the snapshot it gathered before), has the leader's
:class:`ChunkExchange` move it, and hands the results on (scattered back to the ranks, or copied
into the round's result). :class:`ChunkExchange` is the leader's side: it quantizes its island's
chunk once, the link all-gathers every island's payload, and every island decodes all of them and
merges them in island order (token-weighted, or per expert with expert weighting). What the codec
dropped from this island's chunk is the chunk of the next error-feedback residual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_islands.codecs import Codec
from lightning_islands.codecs.buffers import Buffers
from lightning_islands.engine import outer
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.merging import MergePlan
from lightning_islands.engine.stats import RoundStats
from lightning_islands.link.protocol import Link

LINK_TOTALS = ("bytes_sent", "bytes_received", "seconds_exchanging", "seconds_waiting")


class ChunkExchange:
    """The leader's side of one round: :meth:`run` once per chunk, in order.

    Args:
        codec: the wire format.
        link: the other islands (``None`` for a lone island).
        island: this island's index.
        plan: the round's merge: the members (an island left out, a non-finite or outlying
            pseudo-gradient, still sends, is not decoded, and when it is this one, keeps no residual
            from the round), every island's weight, the per-expert coefficients.
        layout: the canonical layout (where each expert parameter lies in the flat vector).
        delta_sq: this island's pseudo-gradient's squared norm (for the round's metrics).
        keep_residual: whether to return what the codec dropped (error feedback).
    """

    def __init__(self, codec: Codec, link: Link | None, island: int, plan: MergePlan, layout: CanonicalLayout,
                 delta_sq: float, keep_residual: bool) -> None:
        self.codec, self.link, self.island = codec, link, island
        self.members, self.weights, self.coefs = plan.members, plan.weights, plan.coefs
        self.layout, self.stats = layout, RoundStats(len(plan.members), delta_sq)
        self.keep_residual = keep_residual
        self.link_sums = dict.fromkeys(LINK_TOTALS, 0.0)
        self.scratch = Buffers()  # the leader's chunk-sized temporaries, reused by every chunk of the round

    def run(self, part: Tensor, start: int) -> tuple[Tensor, Tensor | None]:
        """Quantize this chunk of what the island sends (``part``, the flat vector's values from
        ``start``) once, exchange it, merge every island's in island order. Returns the merged chunk
        and, with error feedback, what quantization dropped from it: both in the scratch buffers,
        valid until the next chunk."""
        scratch, codec = self.scratch, self.codec
        m, dev = part.numel(), part.device
        residual = scratch.take("residual", m, device=dev) if self.keep_residual else None
        if self.island in self.members:
            payload = codec.encode(part, out=scratch.take("payload", codec.nbytes(m), torch.uint8, dev),
                                   scratch=scratch)
            own = codec.decode(payload, out=scratch.take("own", m, device=dev), scratch=scratch)
            if residual is not None:
                torch.sub(part, own, out=residual)
        else:  # left out: nothing to send (nobody decodes it), and nothing carried into the next round
            payload, own = torch.empty(0, dtype=torch.uint8, device=dev), part
            if residual is not None:
                residual.zero_()
        decoded = [own]
        if self.link is not None:
            payloads = self.link.all_gather_bytes(payload, limit=codec.nbytes(m))
            decoded = [own if i == self.island else
                       codec.decode(payloads[i].to(dev), out=scratch.take(f"decoded{i}", m, device=dev),
                                    scratch=scratch)
                       for i in self.members]
            moved = self.link.take_stats()
            for key in LINK_TOTALS:
                self.link_sums[key] += getattr(moved, key)
        merged = outer.merge(decoded, [self.weights[i] for i in self.members],
                             out=scratch.take("merged", m, device=dev), scratch=scratch.take("term", m, device=dev))
        merge_expert_values(merged, decoded, start, self.layout, self.coefs)
        self.stats.add(part, own, payload.numel(), decoded, merged)
        return merged, residual

    def metrics(self, chunks: int, num_islands: int, error_feedback: bool) -> dict[str, float]:
        """The round's metrics, once every chunk moved (``chunks`` of them)."""
        metrics = self.stats.metrics(error_feedback=error_feedback)
        metrics["islands/exchange_chunks"] = float(chunks)
        metrics["islands/islands_left_out"] = float(num_islands - len(self.members))
        metrics["islands/islands_present"] = float(len(self.link.present) if self.link is not None else 1)
        if self.link is not None:
            metrics.update({f"islands/{key}": value for key, value in self.link_sums.items()})
            metrics["islands/cosine"] = self.stats.cosine()
        return metrics

    def take(self, name: str, numel: int, device: torch.device) -> Tensor:
        """A chunk-sized fp32 scratch tensor (the gathered chunk), reused by every chunk."""
        return self.scratch.take(name, numel, device=device)

    def release(self) -> None:
        """Drop the scratch buffers (after the last chunk; tensors still referenced stay alive)."""
        self.scratch.clear()



def merge_expert_values(merged: Tensor, decoded: Sequence[Tensor], start: int, layout: CanonicalLayout,
                        coefs: dict[str, list[Tensor]]) -> None:
    """Overwrite each expert parameter's values in this chunk of ``merged`` (the flat vector's
    ``[start, start + numel)`` of ``layout``) with the per-expert weighted merge of ``decoded`` (one
    per island merged, in island order; ``coefs``: per expert parameter, each island's shares)."""
    stop = start + merged.numel()
    for e in layout.entries:
        if e.name not in coefs:
            continue
        a, b = max(e.offset, start), min(e.offset + e.numel, stop)
        if a < b:
            parts = [d[a - start : b - start] for d in decoded]
            merged[a - start : b - start] = outer.merge_expert_rows(parts, coefs[e.name], e.numel // e.shape[0],
                                                                    a - e.offset)



Part = Callable[[int, int], "Tensor | None"]
Results = Callable[[int, int, "Tensor | None", "Tensor | None"], None]


def exchange_chunks(exchange: ChunkExchange | None, bounds: Sequence[tuple[int, int]], part: Part,
                    on_leader: Callable[[Callable[[], None]], None], results: Results) -> None:
    """Move a fragment's chunks (``bounds``, in order), whichever thread runs it: ``part(start,
    stop)`` is the chunk of what the island sends (on the leader; ``None`` elsewhere), ``on_leader``
    runs the leader's exchange of it (the island's agreement in a synchronous round, a plain call in
    the leader's background thread), and ``results(start, stop, merged, residual)`` takes the
    merged chunk and what the codec dropped (``None`` off the leader). ``exchange``: the leader's
    (``None`` on the other ranks); its buffers are released before the last chunk's results are
    handed on, so that they have the room."""
    for start, stop in bounds:
        chunk = part(start, stop)
        out: list[Tensor | None] = []
        on_leader(lambda chunk=chunk, start=start, out=out: out.extend(exchange.run(chunk, start)))  # type: ignore
        del chunk  # the next chunk reuses the leader's buffers
        if exchange is not None and stop == bounds[-1][1]:
            exchange.release()
        merged, residual = out if out else (None, None)
        results(start, stop, merged, residual)

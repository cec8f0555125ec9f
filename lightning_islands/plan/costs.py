"""What one round costs, piece by piece, in closed form: payload sizes, the leader's local work, the link.

A round moves one fragment of ``m`` values. The exchange cuts it into chunks of
``exchange_chunk_mib`` MiB of fp32 (rounded down to whole codec blocks, as the engine does) that run
one after another; each chunk's payload is the codec's own ``nbytes`` of the chunk, padded to a
multiple of the lane count (the transport splits it into equal pieces, one per lane, sized by the
largest island's payload).

The leader's work is counted in passes over the chunk's fp32 values at ``leader_bytes_per_s``:
encoding (and decoding its own payload, which the merge uses) is :data:`ENCODE_PASSES`, each other
island's payload :data:`DECODE_PASSES`, and the token-weighted merge :data:`MERGE_PASSES` per island.
Each rank forms its pseudo-gradient (:data:`PREP_PASSES`) before a round and takes the outer step
(:data:`OUTER_PASSES`) after it, over its own shard. These pass counts are estimates of the engine's
elementwise work; the throughput is the knob to calibrate against measured runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_islands.plan.inputs import PlanInputs

FP32_BYTES = 4
ENCODE_PASSES = 2.0  # encode the chunk, decode the island's own payload
DECODE_PASSES = 1.0  # per other island's payload
MERGE_PASSES = 2.0  # per island: a weighted term and its sum, one IEEE operation each
PREP_PASSES = 3.0  # per rank and value: anchor - local, plus the error-feedback residual
OUTER_PASSES = 6.0  # per rank and value: momentum, Nesterov, anchor update, write to the local shard


def exchange_chunk_numel(mib: float | None, alignment: int) -> int | None:
    """Values exchanged at a time for chunks of ``mib`` MiB of fp32, rounded down to a multiple of the
    codec's ``alignment`` (at least one); ``None`` (the whole fragment) for ``mib`` None or 0. The same
    rule as the engine's (``lightning_islands.engine.outer.exchange_chunk_numel``)."""
    if not mib:
        return None
    return max(alignment, int(mib * (1 << 18)) // alignment * alignment)


def chunk_kinds(m: int, chunk: int | None) -> list[tuple[int, int]]:
    """The chunks of a fragment of ``m`` values, in order, as ``(values, how many)``: full chunks first,
    then the remainder."""
    if chunk is None or chunk >= m:
        return [(m, 1)]
    full, rest = divmod(m, chunk)
    return [(chunk, full)] + ([(rest, 1)] if rest else [])


@dataclass(frozen=True)
class ChunkCost:
    """One kind of chunk of a fragment: its size, how often it occurs, and what moving it costs.

    ``pre[i]`` / ``post[i]``: island ``i``'s local work before the size all-gather of the chunk and
    after its payload arrived (leader codec work; in a synchronous round also the chunk's gather and
    scatter); ``transfer_s``: the payload all-gather (ring steps, latency included); ``busy_s``: the
    same without latency; ``wire_bytes``: bytes each island sends for it (padded payload times
    ``N - 1``, times the parallel slices of the sliced path)."""

    numel: int
    count: int
    payload_bytes: int
    wire_bytes: int
    transfer_s: float
    busy_s: float
    pre: tuple[float, ...]
    post: tuple[float, ...]


@dataclass(frozen=True)
class FragmentCost:
    """One round's costs for a fragment of ``numel`` values.

    Blocking, per island: ``prep`` (pseudo-gradient, plus the whole fragment's gather to the leader when
    the round overlaps), ``finish`` (the scatter when it overlaps, then the outer step). The chunks move
    in order; ``sizes_s`` is the latency of each chunk's size all-gather. ``blocking`` is an island's
    own work that stops its training (``prep``, ``finish`` and, in a synchronous round, every chunk's
    ``pre`` and ``post``). ``leader_s``, ``link_s`` and ``latency_s`` say where a round's time goes: the
    leader's path (gather, codec, merge, scatter), the payload on the wire (latency included), and the
    round trips alone (the header's three, and per chunk the size and the payload all-gathers)."""

    numel: int
    chunks: tuple[ChunkCost, ...]
    prep: tuple[float, ...]
    finish: tuple[float, ...]
    sizes_s: float
    wire_bytes: int
    leader_s: tuple[float, ...]
    blocking: tuple[float, ...]
    link_s: float
    latency_s: float
    leader_bytes: int

    def train_seconds(self) -> float:
        """Seconds from the end of the first chunk's size all-gather to the last chunk's payload arriving
        (every island alike: each later chunk's size all-gather waits for the slowest island's work
        between the two payloads)."""
        islands = range(len(self.prep))
        total, prev = 0.0, None
        for kind in self.chunks:
            again = max(kind.post[i] + kind.pre[i] for i in islands) + self.sizes_s + kind.transfer_s
            if prev is not None:
                total += max(prev.post[i] + kind.pre[i] for i in islands) + self.sizes_s
            total += kind.transfer_s + (kind.count - 1) * again
            prev = kind
        return total

    @property
    def busy_s(self) -> float:
        """Seconds the round's payloads keep an island's egress busy (latency left out)."""
        return sum(k.count * k.busy_s for k in self.chunks)


def _seconds(nbytes: float, rate: float) -> float:
    return 0.0 if nbytes == 0 or math.isinf(rate) else nbytes / rate


def fragment_cost(inputs: PlanInputs, m: int) -> FragmentCost:
    """The costs of a round that syncs a fragment of ``m`` values (see the module's docstring).

    With ``exchange_path="sliced"`` the fragment moves as ``P`` slices in parallel (``P``: the smallest
    island's devices), each over its own lanes and chunked on its own; an island's codec work spreads
    over all its devices, and each slice's owner receives its slice from the island's other ranks (an
    all-to-all: every owner at its own intra-island rate, in parallel) and sends the results back.
    """
    codec, link = inputs.codec_obj, inputs.link
    n, peers = inputs.num_islands, inputs.peers
    # a ring all-gather takes N - 1 steps of latency; the butterfly's swaps go to the partners at once
    ring = 1 if inputs.topology == "butterfly" and n > 1 else n - 1
    overlap = inputs.overlap_steps > 0
    sliced = inputs.exchange_path == "sliced"
    parallel = min(i.devices for i in inputs.islands) if sliced else 1
    chunk = exchange_chunk_numel(inputs.exchange_chunk_mib, codec.alignment)
    kinds = chunk_kinds(-(-m // parallel), chunk)
    rate = link.rate_bps(inputs.streams)
    step_latency = link.ring_step_rtts * link.rtt_s
    scatters = 2.0 if inputs.use_error_feedback else 1.0  # the merged values, and the new residual

    def codec_work(i: int, values: int, passes: float) -> float:  # ``values`` of each parallel slice
        spec = inputs.islands[i]
        share = values * parallel / spec.devices if sliced else values
        return _seconds(passes * FP32_BYTES * share, spec.leader_bytes_per_s)

    def moved(i: int, values: int) -> float:  # gather (or one scatter) of ``values`` to / from the leader,
        spec = inputs.islands[i]                # or (sliced) of each slice's ``values`` to / from its owner
        return _seconds(FP32_BYTES * values * (spec.devices - 1) / spec.devices, spec.intra_bytes_per_s)

    per_owner = -(-m // parallel)  # the values one rank gathers: the fragment, or (sliced) its slice

    merge_passes = peers * DECODE_PASSES + (peers + 1) * MERGE_PASSES
    chunks = []
    for values, count in kinds:
        payload = codec.nbytes(values)
        padded = -(-payload // inputs.lanes) * inputs.lanes
        wire = padded * peers * parallel
        busy = _seconds(wire * 8, rate)
        pre = tuple(codec_work(i, values, ENCODE_PASSES) + (0.0 if overlap else moved(i, values)) for i in range(n))
        post = tuple(codec_work(i, values, merge_passes) + (0.0 if overlap else scatters * moved(i, values))
                     for i in range(n))
        chunks.append(ChunkCost(values, count, payload, wire, ring * step_latency + busy, busy, pre, post))

    def rank_passes(i: int, passes: float) -> float:
        spec = inputs.islands[i]
        return _seconds(passes * FP32_BYTES * m / spec.devices, spec.leader_bytes_per_s)

    prep = tuple(rank_passes(i, PREP_PASSES) + (moved(i, per_owner) if overlap else 0.0) for i in range(n))
    finish = tuple(rank_passes(i, OUTER_PASSES) + (scatters * moved(i, per_owner) if overlap else 0.0)
                   for i in range(n))
    codec_s = [sum(k.count * codec_work(i, k.numel, ENCODE_PASSES + merge_passes) for k in chunks) for i in range(n)]
    leader = tuple(codec_s[i] + (1.0 + scatters) * moved(i, per_owner) for i in range(n))
    in_chunks = [0.0 if overlap else sum(k.count * (k.pre[i] + k.post[i]) for k in chunks) for i in range(n)]
    blocking = tuple(prep[i] + finish[i] + in_chunks[i] for i in range(n))
    held = m if overlap or chunk is None else min(m, chunk)
    return FragmentCost(
        numel=m, chunks=tuple(chunks), prep=prep, finish=finish,
        sizes_s=ring * step_latency,
        wire_bytes=sum(k.count * k.wire_bytes for k in chunks),
        leader_s=leader, blocking=blocking,
        link_s=sum(k.count * k.transfer_s for k in chunks),
        latency_s=(3 * link.store_rtt if n > 1 else 0.0) + sum(k.count for k in chunks) * 2 * ring * step_latency,
        leader_bytes=0 if sliced else FP32_BYTES * held,
    )

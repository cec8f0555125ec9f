"""The islands' engine: DiLoCo across islands, without Lightning.

One module an idea:

    settings   IslandSettings (validated) and the fingerprint islands compare
    schedule   H per round, its warm-up, time balancing, max_rounds, the round's clock
    state      OuterState: anchors, outer momentum, error-feedback residual (state_dict)
    round      IslandEngine: the round's sequence, its two halves (start / finish)
    driver     RoundDriver: when a training loop's rounds land and start, and the end of training
    header     RoundHeader: what an island tells the others before a round, and its wire form
    island     Island: this rank's island, its ranks and link; agree() carries the leader's result
    rendezvous before the rounds: meet, the initial state, the start agreement
    attempts   a round's attempts: again after a lost island, rejoined, ended
    meeting    RoundMeeting: the leader's round with the others (headers, exchange, settling)
    merging    MergePlan: the members, weights and expert coefficients, from the headers
    exchange   the one chunk loop, and the leader's chunk: encode once, all-gather, decode, merge
    flight     an overlapped round: its exchange in the leader's background thread, its landing
    fragments  which parameters sync together (Streaming DiLoCo)
    health     the per-round state checksum, the majority, and the repair of a drifted island
    layout     the canonical layout and its gather to / scatter from the island's leader
    group      what the engine needs from the island's ranks (IslandGroup) and from the link (Link)
    outer      the math: pseudo-gradients, the merge, expert weighting, outer SGD
    stats      a round's metrics, a chunk at a time
    floatenv   whether a device flushes subnormals (part of the fingerprint)
    checkpoint the outer state as a distributed checkpoint beside the module's
    saves      durable saves, their recovery after a crash, checkpoints by round
    safe_metadata  a distributed checkpoint's .metadata read without running code

It imports torch, the codecs and the transport, never Lightning (a test enforces it).
"""

from lightning_islands.engine.driver import RoundDriver
from lightning_islands.engine.group import IslandGroup, SoloGroup, TorchGroup
from lightning_islands.engine.header import HeaderError, RoundHeader, StateSummary
from lightning_islands.engine.layout import CanonicalLayout
from lightning_islands.engine.round import IslandEngine, PendingRound
from lightning_islands.engine.schedule import Schedule
from lightning_islands.engine.settings import IslandSettings, compare_fingerprints
from lightning_islands.engine.state import OuterState
from lightning_islands.link.protocol import Link

__all__ = ["CanonicalLayout", "HeaderError", "IslandEngine", "IslandGroup", "IslandSettings", "Link", "OuterState",
           "PendingRound", "RoundDriver", "RoundHeader", "Schedule", "SoloGroup", "StateSummary", "TorchGroup",
           "compare_fingerprints"]

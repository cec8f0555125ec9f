"""Everything between islands: the link an island's leader talks to the other islands over.

One module an idea:

    protocol     Link, the whole interface the engine and the strategy use, its errors, LinkStats
    coordinator  the coordinator (a TCPStore server, or etcd), the island's identity from the environment
    etcd_store   EtcdStore: a torch.distributed.Store on an etcd cluster (transactions, watches, leases)
    waiting      the one way the link waits: a poll, a scan, progress and a deadline
    liveness     the island's liveness beat (progress; reconnecting with backoff), its status beats
    membership   who takes part in a round: decided once in the store, attempts, rejoin requests
    sweeper      deletes the keys of rounds long over, off the rounds' path
    lanes        the gloo groups one member set's payloads move on, several streams per pair
    island_link  IslandLink: the real Link, built from the above
    auth         AuthenticatedLink: any Link with an HMAC on every payload and object

The engine imports this package's protocol and nothing else of it (a test enforces it); the
network emulator that shapes the wire on one machine is ``lightning_islands.app.netns``.
"""

from lightning_islands.link.protocol import (
    AuthenticationError,
    CoordinatorLost,
    DeadlinePassed,
    IslandAborted,
    LateForRound,
    Link,
    LinkStats,
    PayloadRefused,
    QuorumLost,
    RoundLost,
    RunEnded,
)

__all__ = ["AuthenticationError", "CoordinatorLost", "DeadlinePassed", "IslandAborted", "LateForRound", "Link",
           "LinkStats", "PayloadRefused", "QuorumLost", "RoundLost", "RunEnded"]

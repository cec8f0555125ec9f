"""One process of an island behind a shaped link (tests/test_netns.py): how fast the island's own
gloo group moves bytes between its ranks, and how fast the leader's lanes move them to the other
island, with the bytes the link interface carried meanwhile (its counters in /proc/net/dev, which
show the reader's own namespace). ``python link_probe.py OUT_DIR INTRA_MB LANE_MB``; the leader
writes OUT_DIR/island{i}.json."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from lightning_islands.startup import startup_imports

# torch: a fifth less CPU at start (see lightning_islands.startup)
with startup_imports(main=__name__ == "__main__"):
    import torch
    import torch.distributed as dist

    from lightning_islands.app.netns import interface_bytes
    from lightning_islands.link.coordinator import island_identity
    from lightning_islands.link.island_link import IslandLink



def link_bytes() -> int:
    """Bytes received plus sent so far by this namespace's end of the shaped link."""
    return interface_bytes(os.environ["LI_LINK_IFNAME"])


out, intra_mb, lane_mb = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
island, num_islands, coordinator, run_id = island_identity()
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
record: dict = {"island": island, "world": world, "env": {k: os.environ.get(k) for k in
                ("LI_COORDINATOR", "LI_LINK_IFNAME", "GLOO_SOCKET_IFNAME", "MASTER_ADDR")}}
if world > 1:  # the island's own group: its ranks on this namespace's loopback
    n = int(intra_mb * 1e6)
    mine, outs = torch.full((n,), rank, dtype=torch.uint8), [torch.empty(n, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(outs, mine)  # warm
    dist.barrier()
    before, t0 = link_bytes(), time.perf_counter()
    dist.all_gather(outs, mine)
    record["intra_bps"] = n * 8 / (time.perf_counter() - t0)
    dist.barrier()
    record["intra_bytes"], record["link_bytes_during_intra"] = n * (world - 1), link_bytes() - before
if rank == 0:
    link = IslandLink(coordinator, island, num_islands, run_id=run_id, lanes=2, deadline=timedelta(seconds=60))
    link.gather_objects("ready", True)
    link.open_lanes()
    link.all_gather_bytes(torch.zeros(1024, dtype=torch.uint8))
    link.gather_objects("go", True)
    n = int(lane_mb * 1e6)
    before, t0 = link_bytes(), time.perf_counter()
    got = link.all_gather_bytes(torch.full((n,), island, dtype=torch.uint8))
    record["lane_bps"] = n * 8 / (time.perf_counter() - t0)
    record["lane_bytes"], record["link_bytes_during_lanes"] = n, link_bytes() - before
    record["intact"] = all(bool((g == i).all()) for i, g in enumerate(got))
    link.gather_objects("done", True)
    (out / f"island{island}.json").write_text(json.dumps(record))
dist.barrier()
dist.destroy_process_group()

"""Plan a run before booking GPUs: what utilization a schedule gets over a given link.

An event-level model of the schedule the islands run (inner steps, time balancing, fragments,
overlap, the round header through the coordinator, chunked exchanges over gloo lanes, the leader's
gather, codec work and scatter) at any scale. No Lightning, no torch.distributed: payload sizes come
from the codecs' own size formulas. The modules, one idea each:

    inputs     IslandSpec, LinkSpec, PlanInputs: what a plan is told, validated
    fragments  fragment sizes from a model's blocks (strided or sequential layout)
    schedule   inner steps per island and round (H / F, time balancing, warm-up)
    costs      one round's costs in closed form: payloads, the leader's work, the link
    simulate   the discrete-event model (SimPy) and its measurement
    result     PlanResult: utilization, where the time goes, the link's load
    search     the smallest link bandwidth that keeps utilization above a target
    hardware   accelerator figures and step times from FLOP/s
    config     plans from the Hydra config's ``islands.*`` (and :func:`prediction_for`)
    frontier   the frontier tables of docs/PLANNING.md
"""

from lightning_islands.plan.inputs import IslandSpec, LinkSpec, PlanInputs, default_tcp_window, with_link
from lightning_islands.plan.result import IslandResult, PlanResult
from lightning_islands.plan.simulate import simulate

__all__ = ["IslandResult", "IslandSpec", "LinkSpec", "PlanInputs", "PlanResult", "default_tcp_window",
           "simulate", "with_link"]

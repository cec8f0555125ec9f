"""The round as its own engine: islands and their ranks as threads of one test, no Lightning, no torchrun.

Each island runs a few inner steps of an elementwise "optimizer" (each rank on its own shards, so
islands that shard differently still train alike) and calls the engine; the link between islands is
the in-memory test double of the transport (:mod:`doubles`) or the real one over loopback.
"""

from __future__ import annotations

import ast
import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import references
import torch
from doubles import Hub, MemoryLink, MemoryRankLink, ThreadGroup, ThreadIsland, run_threads

from lightning_islands.engine import CanonicalLayout, IslandEngine, IslandSettings, outer

# rows that 2 and 3 ranks split unevenly, an expert parameter [4 experts, 3], a scalar-like bias
SPECS = [("embed", (700, 6), True), ("proj", (5, 400), True), ("bias", (40,), False), ("experts", (4, 300), True)]
NUMEL = sum(torch.Size(s).numel() for _, s, _ in SPECS)
INNER_LR = 0.3


def initial_flat(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def target(island: int, step: int) -> torch.Tensor:
    """What island ``island`` pulls its parameters towards at inner step ``step`` (its own data)."""
    g = torch.Generator().manual_seed(1000 * island + step)
    return torch.randn(NUMEL, generator=g) + island


def inner_steps(engine: IslandEngine, locals_: list[torch.Tensor], island: int, tokens: int) -> None:
    """Inner steps of island ``island`` up to the end of the engine's round: each rank moves its own
    shards towards the island's target of the step (an elementwise optimizer, so every sharding
    trains alike) and counts its tokens."""
    for _ in range(engine.schedule.steps_per_round - engine.schedule.round_steps):
        goal = target(island, engine.schedule.inner_steps)
        for i, loc in enumerate(locals_):
            loc.sub_(torch.mul(torch.sub(loc, engine.layout.shard_of(goal, i)), INNER_LR))
        engine.count_tokens(tokens)
        engine.schedule.close_step()


@dataclass
class Plan:
    """A run of islands: one entry per island in ``sizes`` (ranks) and ``tokens`` (per rank per step)."""

    sizes: list[int]
    tokens: list[int]
    rounds: int = 3
    settings: dict[str, Any] = field(default_factory=dict)
    same_seed: bool = False
    stop_island_round: tuple[int, int] | None = None  # (island, round) that says "stop"
    experts: list[list[float]] | None = None  # tokens per expert, per island (expert weighting)


def _rank_main(plan: Plan, island: int, rank: int, group: ThreadGroup, hub: Hub, resume: dict | None = None
               ) -> dict[str, Any]:
    # fp32 unless a plan says otherwise: the reference DiLoCo below merges exact pseudo-gradients
    settings = IslandSettings(**{"sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9, "codec": "fp32",
                                 **plan.settings})
    layout = CanonicalLayout(SPECS, group)
    engine = IslandEngine(settings, layout, island, len(plan.sizes), torch.device("cpu"), torch.device("cpu"))
    start = initial_flat(0 if plan.same_seed else island)
    locals_ = [layout.shard_of(start, i).clone() for i in range(len(SPECS))]
    if len(plan.sizes) > 1:
        engine.meet(lambda: MemoryLink(hub, island), settings.fingerprint(layout, False, "cpu"),
                    open_rank_link=lambda: MemoryRankLink(hub, island, rank))
    engine.adopt_initial_state(locals_, {})
    if resume is not None:
        saved = resume[island, rank]
        for loc, t in zip(locals_, saved["locals"]):
            loc.copy_(t)
        engine.state.load_state_dict(saved["state"])
        engine.schedule.load_state_dict(saved["schedule"])
    rounds, metrics = [], []
    while engine.schedule.round < plan.rounds and not engine.schedule.stopping:
        inner_steps(engine, locals_, island, plan.tokens[island])
        stop = plan.stop_island_round == (island, engine.schedule.round)
        experts = None
        if plan.experts is not None:
            experts = {"experts": plan.experts[island]} if rank == 0 else {"experts": [0.0] * 4}
            experts = {"experts": group.sum(experts["experts"])}
        m, _ = engine.run_round(locals_, experts, stop)
        metrics.append(m)
        flat = engine.global_flat()
        rounds.append(None if flat is None else flat.clone())
    return {"rounds": rounds, "metrics": metrics, "digest": engine.global_state_digest(),
            "locals": [t.clone() for t in locals_], "state": copy.deepcopy(engine.state.state_dict()),
            "schedule": engine.schedule.state_dict(), "residual": engine.state.residual}


def run(plan: Plan, resume: dict | None = None) -> dict[tuple[int, int], dict[str, Any]]:
    """Every rank of every island as a thread; results by ``(island, rank)``."""
    hub = Hub(len(plan.sizes))
    jobs, keys = [], []
    for island, size in enumerate(plan.sizes):
        shared = ThreadIsland(size)
        for rank in range(size):
            group = ThreadGroup(shared, rank)
            jobs.append(lambda i=island, r=rank, g=group: _rank_main(plan, i, r, g, hub, resume))
            keys.append((island, rank))
    return dict(zip(keys, run_threads(jobs)))


def leaders(results: dict) -> list[dict]:
    return [results[i, 0] for i in range(1 + max(i for i, _ in results))]


def assert_identical(results: dict) -> list[torch.Tensor]:
    """Every island's global state after every round is the same, bit for bit; returns island 0's."""
    first, *others = leaders(results)
    for other in others:
        assert len(other["rounds"]) == len(first["rounds"])
        for r, (a, b) in enumerate(zip(first["rounds"], other["rounds"])):
            assert torch.equal(a, b), f"round {r + 1} differs between islands"
        assert other["digest"] == first["digest"]
    return first["rounds"]


def reference(plan: Plan) -> list[torch.Tensor]:
    """DiLoCo from the paper, in float64 on full tensors: H inner steps per island from the global
    parameters, pseudo-gradients weighted by tokens, outer SGD with Nesterov momentum."""
    s = {"sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9, **plan.settings}
    glob, buf, out, step = initial_flat(0).double(), None, [], 0
    for _ in range(plan.rounds):
        deltas, weights = [], []
        for island, size in enumerate(plan.sizes):
            local = glob.clone()
            for k in range(s["sync_every"]):
                local = local - INNER_LR * (local - target(island, step + k).double())
            deltas.append(glob - local)
            weights.append(size * plan.tokens[island] * s["sync_every"])
        step += s["sync_every"]
        merged = sum(w / sum(weights) * d for w, d in zip(weights, deltas))
        buf = merged.clone() if buf is None else s["outer_momentum"] * buf + merged
        glob = glob - s["outer_lr"] * (merged + s["outer_momentum"] * buf)
        out.append(glob.float())
    return out


def test_islands_of_different_shardings_stay_identical_and_match_reference_diloco():
    plan = Plan(sizes=[1, 2, 3], tokens=[8, 3, 5])
    results = run(plan)
    got = assert_identical(results)
    for r, want in enumerate(reference(plan)):
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5)
    # different seeds: island 0's initial state crossed the link, and every rank holds the global shards
    first, last = leaders(results)[0]["metrics"][0], leaders(results)[0]["metrics"][-1]
    assert last["islands/round"] == 3 and last["islands/round_tokens"] == 8 * 3
    assert last["islands/bytes_sent"] == pytest.approx(2 * last["islands/payload_bytes"])  # two peers
    assert first["islands/bytes_sent"] > 2 * first["islands/payload_bytes"], "the initial state counts in round 1"
    for (island, rank), res in results.items():
        layout = CanonicalLayout(SPECS, ThreadGroup(ThreadIsland(plan.sizes[island]), rank))
        for i, anchor in enumerate(res["state"]["anchor"]):
            assert torch.equal(anchor, layout.shard_of(got[-1], i)), f"island {island} rank {rank}: {SPECS[i][0]}"
            assert torch.equal(res["locals"][i], anchor), "after a round the local parameters are the global ones"


@pytest.mark.parametrize("codec", ["int4", "topk:0.2+int2", "fp8", "sign"])
def test_quantized_rounds_stay_identical_across_shardings(codec):
    got = assert_identical(run(Plan(sizes=[2, 3], tokens=[4, 4], settings={"codec": codec, "error_feedback": True})))
    assert not torch.equal(got[0], got[1])


def _ef(decay: float | None) -> tuple[list[torch.Tensor], list[dict[str, float]]]:
    settings = {"codec": "int2", "error_feedback": decay is not None,
                "error_feedback_decay": 1.0 if decay is None else decay}
    results = run(Plan(sizes=[1, 2], tokens=[4, 4], rounds=3, settings=settings))
    return assert_identical(results), leaders(results)[0]["metrics"]


def test_error_feedback_and_its_decay():
    # int2 drops most of each round, so error feedback changes the run. A decay of 0 must be no error
    # feedback at all, bit for bit; 0.25 a run of its own, equal to plain error feedback and to none
    # only in round 1 (no residual yet).
    (none, m_none), (plain, m_plain), (zero, m_zero), (quarter, m_quarter) = (_ef(d) for d in (None, 1.0, 0.0, 0.25))
    assert all(torch.equal(a, b) for a, b in zip(none, zero)), "decay 0 is no error feedback, bit for bit"
    assert torch.equal(none[0], plain[0]) and torch.equal(plain[0], quarter[0]), "round 1 has no residual yet"
    for r in (1, 2):
        assert not torch.equal(quarter[r], plain[r]) and not torch.equal(quarter[r], none[r])
        assert not torch.equal(plain[r], none[r])
    assert "islands/residual_norm" not in m_none[1]
    for name, metrics in (("plain", m_plain), ("zero", m_zero), ("quarter", m_quarter)):
        for r, m in enumerate(metrics):
            # what the round sent, and the part of it the codec held back: the residual it leaves
            sent = m["islands/residual_norm"] / m["islands/quant_rel_error"]
            if r == 0 or name == "zero":  # nothing carried in: the round sent its pseudo-gradient alone
                assert sent == pytest.approx(m["islands/pseudo_grad_norm"], rel=1e-5), (name, r)
            else:
                assert sent != pytest.approx(m["islands/pseudo_grad_norm"], rel=1e-3), (name, r)


def test_the_residual_is_what_the_codec_dropped_and_the_metric_its_norm():
    results = run(Plan(sizes=[1, 2], tokens=[4, 4], rounds=1, settings={"codec": "int2", "error_feedback": True}))
    lead = leaders(results)[1]
    flat = torch.cat([r.reshape(-1) for r in results[1, 0]["residual"]])
    norm = float(torch.linalg.vector_norm(flat.double()))  # rank 0's shards only: a lower bound
    assert 0 < norm <= lead["metrics"][0]["islands/residual_norm"] + 1e-6


@pytest.mark.parametrize("codec", ["fp32", "int4", "topk:0.3+int4"])
def test_a_round_in_chunks_equals_one_whole(codec):
    settings = {"codec": codec, "error_feedback": codec != "fp32"}
    whole = assert_identical(run(Plan(sizes=[2, 1], tokens=[4, 6], settings=settings)))
    # chunks of 2048 values (8 KiB of fp32, whole blocks and packing groups): four, cutting parameters and shards
    small = run(Plan(sizes=[2, 1], tokens=[4, 6], settings={**settings, "exchange_chunk_mib": 2048 * 4 / 2**20}))
    assert leaders(small)[0]["metrics"][0]["islands/exchange_chunks"] == -(-NUMEL // 2048) == 4
    if codec != "topk:0.3+int4":  # top-k keeps its fraction of each chunk: other bytes, by design
        assert all(torch.equal(a, b) for a, b in zip(whole, assert_identical(small)))
    else:
        assert_identical(small)


def test_expert_weighting_merges_each_expert_by_the_tokens_routed_to_it():
    experts = [[10.0, 0.0, 5.0, 0.0], [30.0, 20.0, 5.0, 0.0]]
    plan = Plan(sizes=[1, 2], tokens=[4, 4], rounds=1, experts=experts,
                settings={"expert_weighting": True, "outer_lr": 1.0, "outer_momentum": 0.0})
    results = run(plan)
    got = assert_identical(results)[0]
    e = next(k for k, (n, _, _) in enumerate(SPECS) if n == "experts")
    offset, shape = sum(torch.Size(s).numel() for _, s, _ in SPECS[:e]), SPECS[e][1]
    n = torch.Size(shape).numel()
    start = initial_flat(0)
    deltas = []
    for island in range(2):
        local = start.clone()
        for k in range(3):
            local.sub_(torch.mul(torch.sub(local, target(island, k)), INNER_LR))
        deltas.append(torch.sub(start, local)[offset : offset + n].view(shape))
    merged = references.merge_experts(deltas, outer.expert_coefficients(experts))
    assert torch.equal(got[offset : offset + n].view(shape), torch.sub(start[offset : offset + n].view(shape), merged))
    m = leaders(results)[0]["metrics"][0]
    assert m["islands/expert_share_gap_max"] > 0


def test_one_islands_stop_is_everyones():
    plan = Plan(sizes=[1, 2], tokens=[4, 4], rounds=5, stop_island_round=(1, 1))
    results = run(plan)
    got = assert_identical(results)
    assert len(got) == 2, "the round in which island 1 said stop is the last for both"
    assert all(r["schedule"]["stopping"] for r in results.values())


def test_state_dict_round_trip_resumes_bit_identically():
    plan = Plan(sizes=[2, 1], tokens=[4, 6], rounds=4, settings={"codec": "int4", "error_feedback": True,
                                                                  "error_feedback_decay": 0.5})
    straight = assert_identical(run(plan))
    half = run(Plan(**{**plan.__dict__, "rounds": 2}))
    resumed = run(plan, resume=half)
    assert all(torch.equal(a, b) for a, b in zip(straight[2:], assert_identical(resumed)))


def test_time_balance_gives_the_faster_island_more_steps():
    settings = IslandSettings(sync_every=4, balance="time")
    from lightning_islands.engine import RoundHeader, Schedule

    fast, slow = Schedule(settings, 0), Schedule(settings, 1)
    headers = [RoundHeader(0, step_seconds=0.1), RoundHeader(0, step_seconds=0.3)]
    assert (fast.next_round_steps(headers), slow.next_round_steps(headers)) == (12, 4)
    assert Schedule(settings, 0).next_round_steps([RoundHeader(0, step_seconds=0.001),
                                                   RoundHeader(0, step_seconds=1.0)]) == 32, "at most 8 H"


@pytest.mark.parametrize("kwargs, needle", [
    ([{"outer_lr": 0.7}, {"outer_lr": 0.5}], r"island 1 has outer=.*'lr': 0.5.* but island 0 has outer=.*'lr': 0.7"),
    ([{"lanes": 1}, {"lanes": 3}], r"island 1 has lanes=3 but island 0 has lanes=1"),
    ([{"min_islands": 1}, {"min_islands": 2}], r"island 1 has min_islands=2 but island 0 has min_islands=1"),
    ([{"grace_s": None}, {"grace_s": 5.0}], r"island 1 has grace_s=5.0 but island 0 has grace_s=None"),
    ([{"deadline_s": 3600.0}, {"deadline_s": 60.0}], r"island 1 has deadline_s=60.0 but island 0 has deadline_s=3600"),
], ids=["outer_lr", "lanes", "min_islands", "grace_s", "deadline_s"])
def test_islands_that_differ_are_refused_by_name_before_the_lanes_open(kwargs, needle):
    """A setting that would diverge or hang (different lanes wait for groups that never form) is
    refused at the start, naming it and both values, before any lane is opened."""
    hub = Hub(2)
    opened = []

    class Watched(MemoryLink):
        def open_lanes(self) -> None:
            opened.append(self.island)

    def island(i: int) -> None:
        settings = IslandSettings(sync_every=3, **kwargs[i])
        layout = CanonicalLayout(SPECS)
        engine = IslandEngine(settings, layout, i, 2, torch.device("cpu"), torch.device("cpu"))
        engine.meet(lambda: Watched(hub, i), settings.fingerprint(layout, False, "cpu"))

    with pytest.raises(RuntimeError, match=needle):
        run_threads([lambda: island(0), lambda: island(1)])
    assert opened == []


def test_islands_built_alike_send_no_initial_state():
    results = run(Plan(sizes=[1, 2], tokens=[4, 4], rounds=1, same_seed=True))
    m = leaders(results)[0]["metrics"][0]
    assert m["islands/bytes_sent"] == m["islands/payload_bytes"], "only the round's payload crossed"


LOOPBACK_PLAN = Plan(sizes=[1, 1], tokens=[4, 6], rounds=2, settings={"codec": "int4", "error_feedback": True})


def loopback_island(i: int, make_link: Any, plan: Plan = LOOPBACK_PLAN) -> list[torch.Tensor]:
    """Island ``i`` (of one process) of ``plan`` over the link ``make_link(i)`` returns (a real one);
    its global state after each round."""
    settings = IslandSettings(sync_every=3, outer_lr=0.7, outer_momentum=0.9, **plan.settings)
    layout = CanonicalLayout(SPECS)
    engine = IslandEngine(settings, layout, i, len(plan.sizes), torch.device("cpu"), torch.device("cpu"))
    start = initial_flat(0 if plan.same_seed else i)
    locals_ = [layout.shard_of(start, k).clone() for k in range(len(SPECS))]
    engine.meet(lambda: make_link(i), settings.fingerprint(layout, False, "cpu"))
    engine.adopt_initial_state(locals_, {})
    out = []
    for _ in range(plan.rounds):
        inner_steps(engine, locals_, i, plan.tokens[i])
        engine.run_round(locals_)
        out.append(engine.global_flat().clone())
    return out


def test_the_real_link_over_loopback_gives_the_same_bits():
    """The same two islands over the coordinator and gloo lanes (threads of this process)."""
    from lightning_islands.link.coordinator import Coordinator
    from lightning_islands.link.island_link import IslandLink

    coordinator = Coordinator()
    links = [IslandLink(coordinator.address, i, 2, run_id="loopback", lanes=2) for i in range(2)]
    over_tcp = run_threads([lambda i=i: loopback_island(i, lambda k: links[k]) for i in range(2)])
    for link in links:
        link.close()
    assert all(torch.equal(a, b) for a, b in zip(*over_tcp))
    in_memory = assert_identical(run(LOOPBACK_PLAN))
    assert all(torch.equal(a, b) for a, b in zip(over_tcp[0], in_memory))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_module_the_engine_reaches_imports_lightning():
    """The engine's modules, and every lightning_islands module they import in turn, import neither
    Lightning nor the Lightning glue (the package's own __init__, which names the glue's classes for
    type checkers and loads them lazily, aside: tests/test_packaging.py checks it imports nothing)."""
    root = Path(__import__("lightning_islands").__file__).parent
    todo = [p for p in (root / "engine").glob("*.py")]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            top = name.split(".")[0]
            assert top not in ("lightning", "pytorch_lightning"), f"{path.relative_to(root)} imports {name}"
            assert not name.startswith(("lightning_islands.strategy", "lightning_islands.fsdp")), \
                f"{path.relative_to(root)} imports the Lightning glue ({name})"
            if top == "lightning_islands" and "." in name:
                rel = Path(*name.split(".")[1:])
                for candidate in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
                    if candidate.exists() and candidate != root / "__init__.py":
                        todo.append(candidate)
    assert root / "engine" / "round.py" in seen and root / "link" / "protocol.py" in seen
    assert sys.modules  # the walk is static: nothing was imported


def test_the_engine_imports_of_the_link_its_protocol_only():
    """The link package's Protocol and errors are all the engine knows of it: every engine module's
    import from lightning_islands.link names link.protocol (and the package's own __init__ imports
    nothing else either)."""
    root = Path(__import__("lightning_islands").__file__).parent
    for path in [*(root / "engine").glob("*.py"), root / "link" / "__init__.py"]:
        for name in _imports(path):
            if name.startswith("lightning_islands.link") and name != "lightning_islands.link":
                assert name.startswith("lightning_islands.link.protocol"), f"{path.relative_to(root)} imports {name}"


def test_the_outer_state_round_trips_through_a_checkpoint_and_a_damaged_one_names_itself(tmp_path):
    from lightning_islands.engine.checkpoint import OUTER_DIR, load_outer_state, save_outer_state

    layout = CanonicalLayout(SPECS)
    params = [torch.zeros(s) for _, s, _ in SPECS]
    state = {"anchor": [torch.randn(s) for _, s, _ in SPECS], "momentum": [torch.randn(s) for _, s, _ in SPECS],
             "residual": None, "outer_steps": 3}
    save_outer_state(tmp_path, state, params, layout)
    loaded = load_outer_state(tmp_path, ["anchor", "momentum"], params, layout, params)
    for key in ("anchor", "momentum"):
        assert all(torch.equal(a, b) for a, b in zip(loaded[key], state[key]))
    for f in (tmp_path / OUTER_DIR).glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:10])  # a write cut short
    with pytest.raises(RuntimeError, match=r"(?s)islands_outer .*incomplete or damaged: resume from an earlier one"):
        load_outer_state(tmp_path, ["anchor"], params, layout, params)


def test_a_second_fit_continues_the_rounds_and_the_outer_state():
    cpu = torch.device("cpu")
    settings = IslandSettings(sync_every=2, codec="int4", error_feedback=True)
    layout = CanonicalLayout(SPECS)
    locals_ = [layout.shard_of(initial_flat(0), i).clone() for i in range(len(SPECS))]
    first = IslandEngine(settings, layout, 0, 1, cpu, cpu)
    first.adopt_initial_state(locals_, {})
    inner_steps(first, locals_, 0, 8)
    first.run_round(locals_)
    second = IslandEngine(settings, layout, 0, 1, cpu, cpu)
    second.continue_from(first)
    second.adopt_initial_state(locals_, {})
    assert (second.schedule.round, second.schedule.inner_steps, second.state.optimizer.steps) == (1, 2, 1)
    assert second.state.momentum is not None and second.state.residual is first.state.residual
    assert second.totals is first.totals and all(torch.equal(a, b) for a, b in zip(second.state.anchors, locals_))

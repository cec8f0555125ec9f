"""Tests for lightning_islands.models.parallelize: tensor and expert parallelism of the MoE model,
checked against the unparallelized model in real gloo process groups of two processes.

The four checks that need the two processes run one after the other in one world (the module-scoped
fixture ``world``: starting the processes, each importing torch and the package, costs more than
the checks); each test reads its own check's outcome."""

from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from lightning_islands.app.launch import free_port
from lightning_islands.fsdp import destroy_world
from lightning_islands.models import MoEConfig, MoELanguageModel, MoETransformer, count_parameters, parallelize_moe
from lightning_islands.models.parallelize import check_parallel_sizes

TINY = dict(vocab_size=256, seq_len=32, d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_ff=64)
# Block 0 dense, block 1 MoE with a shared expert: every kind of layer tensor parallelism splits.
TP_TINY = {**TINY, "n_heads": 4, "moe_every": 2, "shared_expert": True}
# fp32: the parallel models add the same terms in another order.
TOL = dict(rtol=5e-6, atol=1e-6)


def spawn(worker, *args, world: int = 2) -> None:
    """Run ``worker(rank, *args)`` in ``world`` processes joined in a gloo process group."""
    mp.spawn(_entry, args=(worker, args, world, free_port()), nprocs=world, join=True)


def _entry(rank, worker, args, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        worker(rank, *args)
    finally:
        destroy_world()  # gloo can abort at interpreter exit otherwise


def tiny(**cfg) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoEConfig(**cfg))


def batch(seed: int, b: int = 4, t: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (b, t + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_of(model, xy):
    """Training loss (as MoELanguageModel's), logits and the aux dict."""
    x, y = xy
    logits, aux = model(x)
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return ce + 0.01 * aux["aux_loss"] + 0.001 * aux["z_loss"], logits, aux


def close(actual, expected, what: str = "") -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}" if what else m)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def grads(model) -> dict[str, torch.Tensor]:
    return {name: full(p.grad) for name, p in model.named_parameters()}


def reference_grads(model, xy) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss, _, _ = loss_of(model, xy)
    loss.backward()
    return loss.detach(), grads(model)


# ---------------------------------------------------------------------------------------------------
# Tensor parallel
# ---------------------------------------------------------------------------------------------------


def _tp_worker(rank: int) -> None:
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(ValueError, match=r"n_heads=1 is not divisible by 2"):
        parallelize_moe(tiny(**{**TINY, "n_heads": 1}), mesh, None)

    reference = tiny(**TP_TINY)
    model = copy.deepcopy(reference)
    assert parallelize_moe(model, mesh, None) == set()
    attn, dense, shared = model.blocks[0].attn, model.blocks[0].mlp, model.blocks[1].mlp.shared
    for linear, dim in [(attn.wq, 0), (attn.wk, 0), (attn.wv, 0), (attn.proj, 1), (dense.w_gate, 0),
                        (dense.w_up, 0), (dense.w_down, 1), (shared.w_gate, 0), (shared.w_down, 1)]:
        assert linear.weight.placements == (Shard(dim),)
        assert linear.weight.to_local().shape[dim] == linear.weight.shape[dim] // 2
    experts = model.blocks[1].mlp
    for p, dim in ((experts.w_gate, 2), (experts.w_up, 2), (experts.w_down, 1)):  # every expert split along d_ff
        assert p.placements == (Shard(dim),) and p.to_local().shape[dim] == p.shape[dim] // 2
    for p in (model.tok_emb.weight, model.norm.weight, model.blocks[1].mlp.router.weight):
        assert not isinstance(p, DTensor)
    assert model.lm_head.weight is model.tok_emb.weight
    assert count_parameters(model) == count_parameters(reference)

    xy = batch(seed=1)  # the same batch on both ranks
    loss, logits, aux = loss_of(model, xy)
    ref_loss, ref_logits, ref_aux = loss_of(reference, xy)
    assert type(logits) is torch.Tensor
    close(logits, ref_logits)
    close(loss, ref_loss)
    assert torch.equal(aux["expert_counts"], ref_aux["expert_counts"])
    loss.backward()
    ref_loss.backward()
    ref_grads = grads(reference)
    for name, grad in grads(model).items():
        close(grad, ref_grads[name], name)


def test_tensor_parallel_matches_the_unparallelized_model(world):
    passed(world, "tensor parallel")


# ---------------------------------------------------------------------------------------------------
# Expert parallel
# ---------------------------------------------------------------------------------------------------


def _ep_worker(rank: int) -> None:
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(ValueError, match=r"n_experts=3 is not divisible by 2"):
        parallelize_moe(tiny(**{**TINY, "n_experts": 3}), None, mesh)

    torch.manual_seed(0)
    module = MoELanguageModel(**TINY)
    reference = copy.deepcopy(module.model)
    experts = module.parallelize(None, mesh)
    model = module.model
    layers = [block.mlp for block in model.blocks]
    assert experts == {getattr(layer, w) for layer in layers for w in ("w_gate", "w_up", "w_down")}
    for p in experts:
        assert p.placements == (Shard(0),) and p.to_local().shape[0] == 2
    assert module.num_parameters() == count_parameters(reference)
    assert set(module.island_token_counts()) <= dict(module.named_parameters()).keys()
    copy.deepcopy(module.model)  # no process group in the modules' attributes

    # Each rank its own batch; data parallelism would average the two ranks' gradients.
    batches = [batch(seed=1), batch(seed=2)]
    dp_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        ref = [reference_grads(reference, xy) for xy in batches]
        model.zero_grad()
        loss, _, aux = loss_of(model, batches[rank])
        _, _, ref_aux = loss_of(reference, batches[rank])
        loss.backward()
        close(loss.detach(), ref[rank][0])
        assert torch.equal(aux["expert_counts"], ref_aux["expert_counts"])  # this rank's tokens, all experts
        for name, p in model.named_parameters():
            if p in experts:  # complete: the average over the ranks
                expected = (ref[0][1][name] + ref[1][1][name]) / 2
                grad = p.grad.full_tensor()
                assert (grad.flatten(1).abs().sum(1) > 0).all(), f"{name}: an expert got no gradient at {step=}"
            else:  # this rank's own, to be averaged by data parallelism
                expected, grad = ref[rank][1][name], p.grad.clone()
                dist.all_reduce(p.grad)
                p.grad /= 2
            close(grad, expected, f"{name}, {step=}")
        for name, p in reference.named_parameters():
            p.grad = (ref[0][1][name] + ref[1][1][name]) / 2
        optimizer.step()
        dp_optimizer.step()
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
        close(full(p.detach()), ref_p.detach(), name)

    # Every token picks experts 0 and 1, both on rank 0: rank 1 receives no rows at all.
    layer, ref_layer = model.blocks[0].mlp, reference.blocks[0].mlp
    with torch.no_grad():
        for router in (layer.router, ref_layer.router):
            router.weight.zero_()
            router.weight[:2] = torch.tensor([[5.0], [4.0]])
    x = 1.0 + 0.1 * torch.randn(16, TINY["d_model"], generator=torch.Generator().manual_seed(rank))
    out, stats = layer(x)
    ref_out, _ = ref_layer(x)
    assert stats["counts"].tolist() == [16, 16, 0, 0]
    close(out, ref_out)
    model.zero_grad()
    out.sum().backward()
    per_expert = layer.w_up.grad.full_tensor().flatten(1).abs().sum(1)
    assert (per_expert[:2] > 0).all() and (per_expert[2:] == 0).all()


def test_expert_parallel_equals_data_parallel(world):
    passed(world, "expert parallel")


# ---------------------------------------------------------------------------------------------------
# Tensor parallel under FSDP2
# ---------------------------------------------------------------------------------------------------


def _tp_fsdp_worker(rank: int) -> None:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    with pytest.raises(ValueError, match="1-D meshes"):
        parallelize_moe(tiny(**TP_TINY), mesh, None)

    reference = tiny(**TP_TINY)
    model = copy.deepcopy(reference)
    ignored = parallelize_moe(model, mesh["tensor_parallel"], None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"], ignored_params=ignored)
    fully_shard(model, mesh=mesh["data_parallel"], ignored_params=ignored)

    xy = batch(seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for _ in range(2):
        loss, _, _ = loss_of(model, xy)
        ref_loss, _, _ = loss_of(reference, xy)
        close(loss, ref_loss)
        for m, opt, lo in ((model, optimizer, loss), (reference, ref_optimizer, ref_loss)):
            m.zero_grad()
            lo.backward()
            opt.step()


def test_tensor_parallel_under_fsdp2(world):
    passed(world, "tensor parallel under FSDP2")


def _ep_fsdp_worker(rank: int) -> None:
    # The experts spread over the data-parallel ranks, FSDP2 shards (and averages) everything else.
    mesh = init_device_mesh("cpu", (2,))
    reference = tiny(**TINY)
    model = copy.deepcopy(reference)
    ignored = parallelize_moe(model, None, mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    for p in ignored:
        assert p.device_mesh is mesh and p.placements == (Shard(0),)  # left as they were

    batches = [batch(seed=4), batch(seed=5)]
    loss, _, _ = loss_of(model, batches[rank])
    loss.backward()
    ref = [reference_grads(reference, xy) for xy in batches]
    close(loss.detach(), ref[rank][0])
    for name, p in model.named_parameters():
        close(p.grad.full_tensor(), (ref[0][1][name] + ref[1][1][name]) / 2, name)


def test_expert_parallel_under_fsdp2(world):
    passed(world, "expert parallel under FSDP2")


# ---------------------------------------------------------------------------------------------------
# One world for the four checks above
# ---------------------------------------------------------------------------------------------------

# Expert parallel under FSDP2 first: its check that the experts keep the very mesh object they were
# given (``is``) fails in a process where earlier checks built meshes of the same shape.
CHECKS = {"expert parallel under FSDP2": _ep_fsdp_worker, "tensor parallel": _tp_worker,
          "expert parallel": _ep_worker, "tensor parallel under FSDP2": _tp_fsdp_worker}


def _every_check(rank: int, out: str) -> None:
    """Each check of CHECKS in turn; ``out/<check>.rank<r>`` records how it ended on this rank. A
    failed check ends the world (the other rank may wait in a collective): those after it do not run."""
    for name, check in CHECKS.items():
        record = os.path.join(out, f"{name.replace(' ', '_')}.rank{rank}")
        try:
            check(rank)
        except BaseException:
            with open(record, "w") as f:
                f.write(traceback.format_exc())
            raise
        open(record + ".ok", "w").close()
        dist.barrier()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Runs every check of CHECKS in one world of two processes; the folder of their records and how
    the world ended (``None``, or the error it raised)."""
    out = tmp_path_factory.mktemp("moe_parallel")
    try:
        spawn(_every_check, str(out))
    except Exception as err:  # noqa: BLE001 - reported by the tests of the checks that failed or did not run
        return out, err
    return out, None


def passed(world, name: str) -> None:
    """Fail with the traceback of check ``name`` on any rank, or because it did not run on both."""
    out, ended = world
    stem = name.replace(" ", "_")
    failed = [p.read_text() for p in sorted(out.glob(f"{stem}.rank[0-9]"))]
    if failed:
        pytest.fail(f"{name}:\n" + "\n".join(failed), pytrace=False)
    ran = sorted(out.glob(f"{stem}.rank[0-9].ok"))
    if len(ran) != 2:
        pytest.fail(f"{name} did not run on both ranks: an earlier check ended the world ({type(ended).__name__})",
                    pytrace=False)


# ---------------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------------


def test_sizes_that_do_not_divide_are_rejected():
    cfg = MoEConfig(**TP_TINY)  # 4 heads, d_ff 64, 4 experts
    check_parallel_sizes(cfg, tp=4, ep=4)
    with pytest.raises(ValueError, match=r"n_heads=4 is not divisible by 3: choose a tensor-parallel size"):
        check_parallel_sizes(cfg, tp=3, ep=1)
    with pytest.raises(ValueError, match=r"d_ff=66 is not divisible by 4: choose a tensor-parallel size"):
        check_parallel_sizes(MoEConfig(**{**TP_TINY, "d_ff": 66}), tp=4, ep=1)
    with pytest.raises(ValueError, match=r"d_ff=66 is not divisible by 4"):  # the experts are split along d_ff too
        check_parallel_sizes(MoEConfig(**{**TINY, "n_heads": 4, "d_ff": 66}), tp=4, ep=1)
    check_parallel_sizes(MoEConfig(**{**TINY, "n_heads": 4, "d_ff": 66, "n_experts": 0}), tp=1, ep=1)
    with pytest.raises(ValueError, match=r"n_experts=4 is not divisible by 3: choose an expert-parallel size"):
        check_parallel_sizes(cfg, tp=1, ep=3)


def test_a_single_process_world_leaves_the_model_alone():
    model = tiny(**TINY)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert parallelize_moe(model, None, None) == set()
    assert all(not isinstance(p, DTensor) for p in model.parameters())
    assert all(layer.ep_mesh is None for layer in (b.mlp for b in model.blocks))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())

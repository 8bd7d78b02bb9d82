"""Tensor parallelism without vLLM: ranks as processes (torch.distributed), each running the paged
adapter over its own KV heads (``keepkv.paged.rank_config``) with no communication of its own, and
the output projection's all-reduce (what vLLM's row-parallel ``o_proj`` does), give the whole
model's projected attention output and, per head, its kept entries, for every served method.

Two ranks on CPU with gloo run in the main suite; on CUDA with NCCL, one GPU per rank, where two
GPUs are present (``.ci/cuda``'s TP=2 case: ``keepkv bench --cuda-suite`` runs this file).
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist

from helpers import slot_positions
from keepkv.paged import SERVED_METHODS, PagedCompression, rank_config
from test_paged import CONFIG, HEAD_DIM, HEADS, KV_HEADS, Engine, tokens

RANKS = 2  # CONFIG's KV heads: one per rank
METHODS = [*SERVED_METHODS, "keepkv+interval=3"]
BUDGETS = [0.5, 3]
STEPS = 10
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all")


def _requests(step: int, generator) -> dict:
    """The requests' new tokens at ``step`` (query [q, H, D], key, value [q, H_kv, D]): two
    prompts of unequal length, then one token each; a third request joins at step 4."""
    new = {r: tokens(generator, length if step == 0 else 1) for r, length in ((0, 9), (1, 14))}
    if step == 4:
        new[2] = tokens(generator, 11)
    return new


def _run(paged: PagedCompression, device, heads: slice, kv_heads: slice, projection: torch.Tensor, reduce=None):
    """Every (method step, request): the projected attention output [q, hidden] of the heads
    ``heads`` (their columns of ``projection`` [hidden, H·D]; summed over the ranks by ``reduce``),
    and per request the positions its slots hold [H_kv, S], after each step."""
    generator = torch.Generator().manual_seed(3)
    layer = CONFIG.num_hidden_layers - 1
    engine = Engine(paged, device=device)
    columns = projection[:, heads.start * HEAD_DIM : heads.stop * HEAD_DIM].to(device)
    projected, kept = [], []
    for step in range(STEPS):
        new = {r: (q[:, heads].to(device), k[:, kv_heads].to(device), v[:, kv_heads].to(device))
               for r, (q, k, v) in _requests(step, generator).items()}
        outputs = engine.step(new, layer)
        for request in new:
            partial = outputs[request].flatten(1) @ columns.T  # [q, hidden]
            projected.append((reduce(partial) if reduce else partial).cpu())
            held = paged.stored(engine.prompt[request], engine.computed[request], layer)
            kept.append(slot_positions(paged, engine.kv_cache, torch.tensor(engine.tables[request]), held, HEAD_DIM).cpu())
    return projected, kept


def _rank(rank: int, backend: str, port: int, out: str) -> None:
    """One rank: its heads' paged steps for every method and budget, no collective while they run,
    the projection all-reduced; rank 0 saves the results, every rank its kept positions."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    projection = torch.randn(CONFIG.hidden_size, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(5))
    group, kv = HEADS // RANKS, KV_HEADS // RANKS
    heads, kv_heads = slice(rank * group, (rank + 1) * group), slice(rank * kv, (rank + 1) * kv)
    called = []
    guarded = {name: getattr(dist, name) for name in COLLECTIVES}
    for name in COLLECTIVES:  # the paged steps may not communicate: only reduce() below does
        setattr(dist, name, lambda *args, name=name, **kwargs: called.append(name))

    def reduce(partial):
        summed = partial.clone()
        guarded["all_reduce"](summed)
        reduced_bytes.append(summed.numel() * summed.element_size())
        return summed

    results = {}
    reduced_bytes = []
    for method in METHODS:
        for budget in BUDGETS:
            paged = PagedCompression(rank_config(CONFIG, group, kv), method, budget)
            results[method, budget] = _run(paged, device, heads, kv_heads, projection, reduce)
    for name, function in guarded.items():
        setattr(dist, name, function)
    torch.save({"results": results, "collectives": called, "reduced_bytes": sum(reduced_bytes)},
               os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("backend", [
    "gloo",
    pytest.param("nccl", marks=pytest.mark.skipif(torch.cuda.device_count() < RANKS, reason="needs two CUDA GPUs")),
])
def test_ranks_compress_their_own_heads_and_reduce_to_the_whole_model(backend, tmp_path):
    """Two ranks (one KV head and its query group each) run every served method's paged steps with
    no collective of their own; the all-reduced output projection is the whole model's to fp32
    rounding, and each rank's kept positions are the whole model's for its head, every step."""
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(backend, _free_port(), str(tmp_path)), nprocs=RANKS, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(RANKS)]
    projection = torch.randn(CONFIG.hidden_size, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(5))
    for answer in ranks:
        assert answer["collectives"] == []
    for method in METHODS:
        for budget in BUDGETS:
            paged = PagedCompression(CONFIG, method, budget)
            expected, kept = _run(paged, "cpu", slice(0, HEADS), slice(0, KV_HEADS), projection)
            for rank, answer in enumerate(ranks):
                got, rank_kept = answer["results"][method, budget]
                for mine, theirs in zip(got, expected):
                    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
                for mine, theirs in zip(rank_kept, kept):
                    assert torch.equal(mine, theirs[rank : rank + 1]), (method, budget, rank)
    tokens_reduced = sum(len(answer) for answer in expected)  # every step's tokens, once per method and budget
    assert ranks[0]["reduced_bytes"] == len(METHODS) * len(BUDGETS) * tokens_reduced * CONFIG.hidden_size * 4

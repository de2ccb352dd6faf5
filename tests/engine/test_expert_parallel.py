"""Expert parallelism with two real processes (gloo over TCP on localhost).

Each rank loads the same checkpoint, keeps only its half of the experts, and
runs its own step sequence; MoE layers exchange tokens every step. Every real
token's logits must equal a single-process (N = 1) run of the same requests.
"""
from __future__ import annotations

import re
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from service.demo.checkpoint import write_demo_checkpoint
from engine.worker.loader import load_model
from engine.models.expert_parallel import ExpertParallel, combine_all_reduce, combine_reduce_scatter, gather_rows
from tests.engine.forward_harness import PagedRunner, engine_config, random_tokens

WORLD = 2
TIMEOUT_S = 120
EP_ATOL = 1e-5
_EXPERT = re.compile(r"^model\.layers\.(\d+)\..*\.experts\.(\d+)\.")

CHECKPOINTS = {
    "deepseek-v3": ("DeepseekV3ForCausalLM", {"num_hidden_layers": 3, "n_routed_experts": 8,
                                              "n_group": 4, "topk_group": 2}),
    "mixtral": ("MixtralForCausalLM", {}),
}


def rank_steps(rank: int, vocab: int) -> list[tuple[dict[str, list[int]], int, bool]]:
    """(batch, pad_to, nan_activations) per step; both ranks take the same number of steps."""
    shared = random_tokens(10, vocab, seed=100)
    steps = [({"same": shared[:7]}, 8, False)]                            # identical on both ranks
    steps += [({"same": [shared[i]]}, 4, False) for i in range(7, 10)]
    if rank == 0:
        own = random_tokens(14, vocab, seed=200)
        steps += [({"own": own[:12]}, 16, False)]
        steps += [({"own": [own[i]]}, 4, False) for i in range(12, 14)]
        steps += [({"own": [random_tokens(1, vocab, seed=300 + i)[0]]}, 1, False) for i in range(2)]
    else:
        x, y = random_tokens(7, vocab, seed=201), random_tokens(8, vocab, seed=202)
        steps += [({"x": x[:5], "y": y[:6]}, 16, False)]                   # different batch, same padding
        steps += [({"x": [x[i]], "y": [y[i + 1]]}, 4, False) for i in range(5, 7)]
        steps += [({}, 3, True) for _ in range(2)]  # dummy batches, other size, NaN activations
    return steps


def run_steps(runner: PagedRunner, steps) -> list[dict[str, torch.Tensor]]:
    return [runner.step(batch, pad_to, nan_activations=nan) for batch, pad_to, nan in steps]


def _worker(rank: int, port: int, paths: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S))
    from engine.models.moe import MoECausalLM
    loaded: list[str] = []
    original = MoECausalLM.load_weight

    def recording_load(self, name, tensor):
        loaded.append(name)
        original(self, name, tensor)
    MoECausalLM.load_weight = recording_load  # this spawned process only

    results = {}
    for case, path in paths.items():
        loaded.clear()
        config = engine_config(path, data_parallel_size=WORLD, data_parallel_rank=rank)
        runner = PagedRunner(config)
        outputs = run_steps(runner, rank_steps(rank, config.model.vocab_size))
        results[case] = {"outputs": outputs, "loaded": list(loaded),
                         "null_block_zero": runner.null_block_is_zero()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    paths = {case: str(write_demo_checkpoint(root / case, arch, init_scale=0.3, seed=3, **over))
             for case, (arch, over) in CHECKPOINTS.items()}
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, paths, str(root))) for rank in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    assert not hung, "expert-parallel ranks deadlocked (timed out)"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return paths, [torch.load(root / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("case", CHECKPOINTS)
def test_expert_parallel_logits_match_single_process(case, ep_run):
    paths, ranks = ep_run
    config = engine_config(paths[case])
    model = load_model(config)
    for rank in range(WORLD):
        steps = rank_steps(rank, config.model.vocab_size)
        reference = run_steps(PagedRunner(config, model), [s for s in steps if s[0]])
        got = [out for out, step in zip(ranks[rank][case]["outputs"], steps) if step[0]]
        assert len(got) == len(reference)
        for step_got, step_ref in zip(got, reference):
            assert step_got.keys() == step_ref.keys()
            for key in step_ref:
                assert torch.isfinite(step_got[key]).all()
                assert (step_got[key] - step_ref[key]).abs().max().item() < EP_ATOL, (rank, key)
        assert ranks[rank][case]["null_block_zero"]


@pytest.mark.parametrize("case", CHECKPOINTS)
def test_each_rank_loads_only_its_experts(case, ep_run):
    paths, ranks = ep_run
    config = engine_config(paths[case])
    num_experts = config.model.num_experts
    per_rank = num_experts // WORLD
    for rank in range(WORLD):
        loaded = ranks[rank][case]["loaded"]
        experts = {int(m.group(2)) for m in map(_EXPERT.match, loaded) if m}
        assert experts == set(range(rank * per_rank, (rank + 1) * per_rank))
        assert any(name.endswith("gate.weight") for name in loaded)  # routers are replicated
        assert len(loaded) == len(set(loaded))


def test_wants_weight_skips_other_ranks_experts(ep_run):
    paths, _ = ep_run
    config = engine_config(paths["deepseek-v3"], data_parallel_size=2, data_parallel_rank=1)
    model = load_model(config)  # loading needs no collectives
    assert not model.wants_weight("model.layers.1.mlp.experts.3.up_proj.weight")
    assert model.wants_weight("model.layers.1.mlp.experts.4.up_proj.weight")
    assert model.wants_weight("model.layers.1.mlp.shared_experts.up_proj.weight")
    experts = model.model.layers[1].mlp.experts
    assert experts.owned == range(4, 8) and len(experts.packed) == 4  # prepacked per local expert on CPU
    expected = model.expected_weights()
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in expected
    assert "model.layers.2.mlp.experts.0.down_proj.weight" not in expected


def test_uneven_expert_split_is_rejected():
    assert ExpertParallel(4, 3).expert_range(8) == range(6, 8)
    with pytest.raises(ValueError, match="evenly"):
        ExpertParallel(3, 0).expert_range(8)


def test_single_rank_runs_no_collectives(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("collective called with data_parallel_size=1")
    for name in ("all_gather", "all_reduce", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, forbidden)
    ep = ExpertParallel(1, 0)
    hidden = torch.randn(3, 4)
    with ep.step(3):
        out = ep.run_experts(lambda h, ids, w: h * 2, hidden, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))
    assert torch.equal(out, hidden * 2)


# -- the NCCL collectives against the gloo ones, on gloo where both run ------------------------------

COUNT_CASES = ([3, 5], [4, 4], [0, 6], [2, 0], [1, 1])  # ragged, even, and a rank with no tokens


def _collectives_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S))
    results = []
    for counts in COUNT_CASES:
        gen = torch.Generator().manual_seed(rank * 100 + sum(counts))
        local = torch.randn(counts[rank], 6, generator=gen)
        partial = torch.randn(sum(counts), 6, generator=gen)  # this rank's experts over every rank's tokens
        results.append({"list": gather_rows(local, counts), "single": gather_rows(local, counts, single_tensor=True),
                        "reduce_scatter": combine_reduce_scatter(partial.clone(), counts, rank),
                        "all_reduce": combine_all_reduce(partial.clone(), counts, rank), "partial": partial})
    torch.save(results, Path(out_dir) / f"collectives{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_reduce_scatter_combine_and_single_tensor_gather_equal_the_gloo_paths(tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_collectives_worker, args=(rank, port, str(tmp_path))) for rank in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    ranks = [torch.load(tmp_path / f"collectives{r}.pt") for r in range(WORLD)]
    for i, counts in enumerate(COUNT_CASES):
        total = ranks[0][i]["partial"] + ranks[1][i]["partial"]
        for rank in range(WORLD):
            got = ranks[rank][i]
            assert torch.equal(got["single"], got["list"]), counts
            assert got["list"].shape == (sum(counts), 6)
            start = sum(counts[:rank])
            assert torch.equal(got["reduce_scatter"], got["all_reduce"]), counts
            assert torch.equal(got["all_reduce"], total[start:start + counts[rank]]), counts

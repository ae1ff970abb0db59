"""Proof that N-process training through distributed.py equals 1-process training.

Every multi-process test runs on real gloo process groups (the session's worker pools, see
harness.py), through the project's own data_sampler, reduce and launch machinery. The training
properties run through ddp_check's engine, the check users point at their own models.

Tolerances (float64 throughout the training properties):
- between replicas: bitwise equality (they apply the same all-reduced gradient);
- N processes vs 1 process: rtol = atol = 1e-9 (through ddp_check: atol = 1e-9 x max(1, the
  reference tensor's largest magnitude)). All-reduce sums gradients in a different order
  than one big batch does; measured worst case here is 1.2e-10 (Adam on near-zero LM gradients,
  where normalising by sqrt(v) amplifies rounding), SGD ~1e-16. A real bug shows as >= 1e-3.
"""
from __future__ import annotations

import copy
import math
import random
import re
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

import distributed
from seeded_dataset import seeded_dataset
from sync_batchnorm import sync_batchnorm
from harness import (CLASSES, FEATURES, SCRIPTS, build_data, build_model, check_training, examples, grad_vector,
                      loss_fn, one_thread, run, task_all_gather, task_eval, task_grads, task_identity,
                      task_readme_evaluate, task_reduce, task_sampler, task_sampler_skip,
                      task_wire_contiguity, readme_snippet, without_numpy)

RTOL = ATOL = 1e-9

worlds = st.integers(1, 4)
allreduces = st.sampled_from(["gloo", "shared-memory"])  # DDP's own, shared_memory_allreduce.py
seeds = st.integers(0, 2**16)


# ---------------------------------------------------------------------------------------------
# 1. Training equivalence
# ---------------------------------------------------------------------------------------------


@settings(max_examples=examples(200))
@given(world=worlds, kind=st.sampled_from(["mlp", "conv", "lm"]), width=st.integers(2, 6),
       batch=st.integers(1, 4), steps=st.integers(1, 3), optim=st.sampled_from(["sgd", "momentum", "adam"]),
       lr=st.sampled_from([0.01, 0.1]), model_seed=seeds, data_seed=seeds, extra=st.integers(0, 5),
       allreduce=allreduces)
def test_n_process_params_equal_one_process_after_every_step(world, kind, width, batch, steps, optim, lr,
                                                              model_seed, data_seed, extra, allreduce):
    """Through ddp_check's engine (the harness users get): the first step's gradients, then the parameters and
    buffers after every step, replicas bitwise equal, rank 0 within RTOL of one process. The batches come from
    data_sampler at epoch 0; its other epochs and shuffle=False are the same partition of another order
    (section 3 proves that), and test_min_ddp trains many epochs against one process."""
    spec = {"kind": kind, "width": width, "batch": batch, "steps": steps, "optim": optim, "lr": lr,
            "model_seed": model_seed, "data_seed": data_seed, "accum": 1, "n": steps * batch * world + extra,
            "allreduce": allreduce}
    check_training(spec, world, RTOL)
    order = list(distributed.data_sampler(build_data(kind, spec["n"], data_seed), True, True, seed=data_seed))
    first = local_gradient(spec, order[:batch * world])
    assert first.abs().max() > 1e-6, "the first step must change the model, or the comparison proves nothing"


# ---------------------------------------------------------------------------------------------
# 2. Gradient accumulation with no_sync
# ---------------------------------------------------------------------------------------------


@settings(max_examples=examples(40))
@given(world=st.integers(2, 4), accum=st.integers(2, 3), kind=st.sampled_from(["mlp", "lm"]),
       batch=st.integers(1, 3), steps=st.integers(1, 2), optim=st.sampled_from(["sgd", "adam"]),
       model_seed=seeds, data_seed=seeds, allreduce=allreduces)
def test_no_sync_accumulation_equals_one_process_over_all_micro_batches(world, accum, kind, batch,
                                                                        steps, optim, model_seed, data_seed,
                                                                        allreduce):
    """ddp_check's standard step: every micro-batch but the last under no_sync(). Its hook on DDP's all-reduce
    (wrapping shared_memory_allreduce's when that runs) fails the check if any micro-step but the last
    all-reduced; the parameters match one process over all micro-batches, in one batch and micro-batch by
    micro-batch."""
    spec = {"kind": kind, "width": 4, "batch": batch, "steps": steps, "optim": optim, "lr": 0.1,
            "model_seed": model_seed, "data_seed": data_seed, "accum": accum, "n": steps * accum * batch * world,
            "allreduce": allreduce}
    check_training(spec, world, RTOL)


def local_gradient(spec: dict, indices: list[int], reduction: str = "mean") -> torch.Tensor:
    with one_thread():
        model = build_model(spec["kind"], spec["width"], spec["model_seed"])
        x, y = build_data(spec["kind"], spec["n"], spec["data_seed"])[indices]
        loss_fn(model, x, y, reduction).backward()
        return grad_vector(model)


# ---------------------------------------------------------------------------------------------
# 3. data_sampler
# ---------------------------------------------------------------------------------------------


@settings(max_examples=examples(80))
@given(world=worlds, n=st.integers(1, 40), shuffle=st.booleans(), pad=st.booleans(), seed=seeds,
       epoch=st.integers(0, 5), batch=st.integers(1, 4))
def test_data_sampler_covers_partitions_and_bridges_to_the_global_batch(pools, world, n, shuffle, pad, seed,
                                                                        epoch, batch):
    spec = {"n": n, "shuffle": shuffle, "pad": pad, "seed": seed, "epochs": [epoch]}
    results = pools.run(world, task_sampler, spec)
    if pad and n < world:
        for message in results:
            assert f"has {n} samples but the world size is {world}" in message
        return
    shards = [res[0] for res in results]
    union = [i for shard in shards for i in shard]
    if pad:
        assert {len(s) for s in shards} == {math.ceil(n / world)}, "pad=True: equal lengths"
        assert set(union) == set(range(n)), "pad=True: every sample covered"
    else:
        assert sorted(union) == list(range(n)), "pad=False: every sample exactly once"
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
    # One permutation shared by all ranks: interleaving the shards rebuilds the 1-process order.
    data = TensorDataset(torch.arange(n))
    global_sampler = distributed.data_sampler(data, True, shuffle, seed=seed)
    global_sampler.set_epoch(epoch)
    global_order = list(global_sampler)
    interleaved = [shards[r][i] for i in range(len(shards[0])) for r in range(world) if i < len(shards[r])]
    assert interleaved[:n] == global_order
    # Batch bridge: the ranks' step-k batches together are the 1-process step-k global batch.
    for k in range(n // (batch * world)):
        together = sorted(i for s in shards for i in s[k * batch:(k + 1) * batch])
        assert together == sorted(global_order[k * batch * world:(k + 1) * batch * world])


def test_set_epoch_reshuffles_and_the_same_epoch_repeats(pools):
    n = 100
    orders = pools.run(2, task_sampler, {"n": n, "shuffle": True, "pad": True, "seed": 7,
                                         "epochs": [0, 1, 2, 0]})[0]
    for a in range(3):
        for b in range(a + 1, 3):
            moved = sum(x != y for x, y in zip(orders[a], orders[b], strict=False))
            assert moved >= 0.8 * len(orders[a]), f"epochs {a} and {b} share too much order ({moved} moved)"
    assert orders[3] == orders[0], "set_epoch(0) again must give epoch 0's order"


def test_padded_sampler_would_count_duplicates_in_evaluation(pools):
    """Why evaluation uses pad=False: padding makes 10 samples count as 12 across 3 ranks."""
    padded = pools.run(3, task_sampler, {"n": 10, "shuffle": False, "pad": True, "seed": 0, "epochs": [0]})
    exact = pools.run(3, task_sampler, {"n": 10, "shuffle": False, "pad": False, "seed": 0, "epochs": [0]})
    assert sum(len(r[0]) for r in padded) == 12
    assert sum(len(r[0]) for r in exact) == 10


def test_not_distributed_sampler_gives_each_rank_all_in_one_process_order(pools):
    """A port that passes its own ``args.distributed`` (False) to data_sampler: each of 2 ranks gets every sample,
    in the order a world of one gets (here, the test's process: no group), resumable mid-epoch like any share
    (the skipped samples never loaded); ``data_sampler(data)`` alone is the common call, distributed and shuffled."""
    spec = {"n": 23, "shuffle": True, "pad": True, "seed": 5, "epoch": 3, "skip": 7, "batch": 4, "distributed": False}
    alone = distributed.data_sampler(TensorDataset(torch.arange(23)), shuffle=True, seed=5)
    alone.set_epoch(3)
    order = list(alone)
    assert sorted(order) == list(range(23)) and order != list(range(23))
    for rank, got in enumerate(pools.run(2, task_sampler_skip, spec)):
        assert got["whole"] == order, f"rank {rank} did not get every sample in one process's order"
        assert got["resumed"] == got["loaded"] == order[7:] and got["len"] == 16 and got["next_len"] == 23
    data = TensorDataset(torch.arange(23))
    default, explicit = distributed.data_sampler(data), distributed.data_sampler(data, True, True)
    assert list(default) == list(explicit) != list(range(23))


# ---------------------------------------------------------------------------------------------
# 4. reduce
# ---------------------------------------------------------------------------------------------

DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.bool]


def expected_reduce(values: list[torch.Tensor], op: str, world: int) -> torch.Tensor:
    stacked = torch.stack(values)
    dtype = values[0].dtype
    if op == "mean":
        wide = stacked.to(torch.float64) if not dtype.is_floating_point else stacked
        return wide.sum(0).to(torch.float64 if not dtype.is_floating_point else dtype) / world
    if op == "sum":
        return stacked.sum(0).to(torch.int64 if dtype == torch.bool else dtype)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


@settings(max_examples=examples(60))
@given(world=worlds, op=st.sampled_from(["sum", "mean", "max", "min"]), dtype=st.sampled_from(DTYPES),
       shape=st.sampled_from([(), (3,), (2, 2)]), seed=seeds)
def test_reduce_is_exact_on_small_integers_and_keeps_shape_and_dtype(pools, world, op, dtype, shape, seed):
    gen = torch.Generator().manual_seed(seed)
    low = 0 if dtype in (torch.uint8, torch.bool) else -5
    high = 2 if dtype == torch.bool else 6
    values = [torch.randint(low, high, shape, generator=gen).to(dtype) for _ in range(world)]
    results = pools.run(world, task_reduce, {"values": values, "op": op})
    expected = expected_reduce(values, op, world)
    for res in results:
        assert res["untouched"] and res["is_new"], "reduce must not modify or return its input"
        assert res["result"].dtype == expected.dtype and res["result"].shape == expected.shape
        assert torch.equal(res["result"], expected), (res["result"], expected)


@settings(max_examples=examples(20))
@given(world=worlds, shape=st.sampled_from([(), (3,), (2, 2)]), dtype=st.sampled_from(DTYPES), seed=seeds)
def test_all_gather_stacks_every_rank_in_rank_order(pools, world, shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randint(0, 2 if dtype == torch.bool else 6, shape, generator=gen).to(dtype) for _ in range(world)]
    for result in pools.run(world, task_all_gather, {"values": values}):
        assert torch.equal(result, torch.stack(values))


def test_collectives_hand_torch_contiguous_tensors_whatever_the_input(pools):
    """`reduce(x.T)` and `all_gather(preds[:, 0])` are strided views: NCCL raises "Tensors must be contiguous"
    on them, on GPUs only, because gloo takes them. What goes on the wire must be contiguous."""
    for got in pools.run(2, task_wire_contiguity, {}):
        assert got["seen"] == [("all_reduce", True), ("all_gather", True)], got["seen"]
        assert torch.equal(got["reduced"], 2 * torch.arange(6.0).reshape(2, 3).T + 1)
        assert torch.equal(got["gathered"], torch.tensor([[0.0, 2, 4], [1, 3, 5]]))


def test_reduce_accepts_python_numbers(pools):
    results = pools.run(2, task_reduce, {"values": [3, 4], "op": "sum"})
    assert all(torch.equal(r["result"], torch.tensor(7)) for r in results)
    results = pools.run(2, task_reduce, {"values": [0.5, 1.5], "op": "mean"})
    assert all(r["result"].item() == 1.0 for r in results)


@pytest.mark.parametrize("backend, device, wire", [("gloo", "cpu", "cpu"), ("nccl", "cpu", "cuda"),
                                                    ("nccl", "cuda:1", "cuda:1"), ("gloo", "cuda:0", "cuda:0")])
def test_collectives_move_cpu_tensors_to_the_gpu_only_under_nccl(backend, device, wire):
    """nccl moves CUDA tensors only ("cuda": the current device); gloo takes tensors where they are."""
    assert distributed._wire_device(backend, torch.device(device)) == torch.device(wire)


def test_reduce_in_one_process_is_a_copy():
    value = torch.tensor([1.0, 2.0], requires_grad=True)
    out = distributed.reduce(value, "sum")
    assert torch.equal(out, value.detach()) and out is not value and not out.requires_grad
    out += 1
    assert torch.equal(value.detach(), torch.tensor([1.0, 2.0]))
    assert distributed.reduce(5, "mean").item() == 5.0


@pytest.mark.parametrize("op", ["avg", "SUM", "", None])
def test_reduce_unknown_op_names_the_op_and_the_choices(op):
    with pytest.raises(ValueError, match=r"unknown op .* use one of sum, mean, max, min"):
        distributed.reduce(torch.ones(1), op)


def task_reduce_complex_max(spec: dict) -> str:
    try:
        distributed.reduce(torch.tensor([1 + 2j]), spec["op"])
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("op", ["max", "min"])
def test_reduce_refuses_max_of_complex_at_every_world_size(pools, op):
    """max/min of complex numbers has no meaning: refused alike at world 1 (it was a copy) and world 2 (it was a
    torch error from inside the all-reduce), naming the op and what to reduce instead."""
    expected = f"reduce: op {op!r} has no meaning for complex numbers (got torch.complex64)"
    assert task_reduce_complex_max({"op": op}).startswith(expected)
    assert all(found.startswith(expected) for found in pools.run(2, task_reduce_complex_max, {"op": op}))


# ---------------------------------------------------------------------------------------------
# 5. Exact evaluation
# ---------------------------------------------------------------------------------------------


@settings(max_examples=examples(40))
@given(world=worlds, n=st.integers(1, 300), batch=st.integers(1, 64), seed=seeds)
def test_distributed_validation_equals_one_process_exactly(pools, world, n, batch, seed):
    """data_sampler(pad=False) and one reduce of (loss sum, correct, samples): every sample counted once,
    so accuracy (a ratio of exact counts) is bitwise equal; the loss is a float64 sum in another order:
    rtol 1e-12 (measured ~1e-16). min_ddp's own evaluation is checked in test_min_ddp.py."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, FEATURES, generator=gen, dtype=torch.float64), torch.randint(CLASSES, (n,), generator=gen)
    with one_thread(), torch.no_grad():
        logits = build_model("mlp", 4, 0)(x)
    ref_loss, ref_correct = F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).sum().item()
    for loss, correct, count in pools.run(world, task_eval, {"x": x, "y": y, "batch": batch}):
        assert (correct, count) == (ref_correct, n)
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=0)


@pytest.mark.parametrize("n", [4, 5])
def test_readme_evaluation_counts_unequal_shards_exactly(pools, n):
    """At world 3, 4 or 5 validation samples shard 2-1-1 or 2-2-1: the README's evaluate(), which reduces sums
    and counts, returns one process's accuracy exactly (a ratio of exact counts); an average of per-rank
    accuracies would be visibly off. min_ddp's evaluate() is checked the same way in test_min_ddp.py."""
    gen = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, FEATURES, generator=gen, dtype=torch.float64), torch.randint(CLASSES, (n,), generator=gen)
    torch.manual_seed(0)
    with torch.no_grad():
        correct = int((torch.nn.Linear(FEATURES, CLASSES).double()(x).argmax(1) == y).sum())
    spec = {"x": x, "y": y, "batch": 2, "source": readme_snippet()}
    assert pools.run(3, task_readme_evaluate, spec) == [correct / n] * 3


# ---------------------------------------------------------------------------------------------
# 6. Characterization: the traps must show, with a margin
# ---------------------------------------------------------------------------------------------


def grads_spec(kind: str, sizes: list[int], reduction: str = "mean", scale: list[float] | None = None) -> dict:
    n = sum(sizes)
    bounds = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
    return {"kind": kind, "width": 4, "model_seed": 3, "data_seed": 4, "n": n, "reduction": reduction,
            "indices": [list(range(bounds[r], bounds[r + 1])) for r in range(len(sizes))],
            "scale": scale or [1.0] * len(sizes)}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_summed_loss_makes_gradients_world_size_times_smaller(pools, world):
    spec = grads_spec("mlp", [4] * world, reduction="sum")
    ddp_grad = pools.run(world, task_grads, spec)[0]
    one_process = local_gradient(spec, list(range(spec["n"])), reduction="sum")
    torch.testing.assert_close(ddp_grad * world, one_process, rtol=RTOL, atol=ATOL)
    assert (one_process - ddp_grad).abs().max() > 0.4 * one_process.abs().max()


def test_unequal_shards_need_rescaling_to_match_one_process(pools):
    sizes = [1, 5]
    one_process = local_gradient(grads_spec("mlp", sizes), list(range(6)))
    plain = pools.run(2, task_grads, grads_spec("mlp", sizes))[0]
    assert (plain - one_process).abs().max() > 1e-2 * one_process.abs().max(), "mean of means != mean"
    rescaled = pools.run(2, task_grads, grads_spec("mlp", sizes, scale=[2 * b / 6 for b in sizes]))[0]
    torch.testing.assert_close(rescaled, one_process, rtol=RTOL, atol=ATOL)


def test_plain_batchnorm_differs_from_one_process_but_its_control_does_not(pools):
    bn = grads_spec("bn", [4, 4])
    diff = (pools.run(2, task_grads, bn)[0] - local_gradient(bn, list(range(8)))).abs().max()
    assert diff > 1e-3, f"local BatchNorm statistics should change the gradient (diff {diff})"
    mlp = grads_spec("mlp", [4, 4])
    torch.testing.assert_close(pools.run(2, task_grads, mlp)[0], local_gradient(mlp, list(range(8))),
                               rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# 7. Identity and the end-to-end job
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exactly_one_primary_and_ranks_are_distinct(pools, world):
    results = pools.run(world, task_identity, {})
    assert [r["primary"] for r in results].count(True) == 1 and results[0]["primary"]
    assert [r["rank"] for r in results] == list(range(world))
    assert {r["world"] for r in results} == {world} and {r["mode"] for r in results} == {"spawn"}
    # As under torchrun and srun: none chosen (the platform's), not the forkserver that started the rank.
    assert {r["start_method"] for r in results} == {None}


@pytest.mark.slow
def test_the_cpu_suite_hides_the_gpus_from_itself_and_every_process_it_starts():
    """Where GPUs are visible, the suite's ranks would take nccl and `--nprocs 2` would be refused on one GPU:
    conftest.py hides them (CUDA_VISIBLE_DEVICES=) from pytest and every process it starts."""
    child = run([sys.executable, "-c", "import os, torch; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), "
                                       "torch.cuda.is_available())"])
    assert child.stdout.split() == ["''", "False"], child.stderr


@pytest.mark.slow
def test_the_gpu_tests_run_only_when_asked_for_and_then_alone():
    collected = run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                    env={"DDP_GPU_TESTS": "1"}, timeout=120)
    assert {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line} == {"tests/test_gpu.py"}, \
        collected.stdout[-2000:]


def test_helpers_behave_as_one_process_before_init():
    assert (distributed.get_rank(), distributed.get_world_size(), distributed.is_primary()) == (0, 1, True)
    assert distributed.launch_mode() == "single"
    distributed.barrier()
    distributed.cleanup()
    distributed.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_print_ranked_prints_one_line_per_rank_in_rank_order_without_numpy(tmp_path, world):
    out = run([sys.executable, str(SCRIPTS / "ranked.py"), str(world)], env=without_numpy(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"[rank {r}] {'é' * r}|line|{r}" for r in range(world)]


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the value and the fix, before anything starts
# ---------------------------------------------------------------------------------------------


def _noop_worker(local_rank: int, world_size: int) -> None:
    pass


@pytest.mark.parametrize("nprocs", [0, -2, 1.5, "2", True])
def test_launch_rejects_bad_nprocs(nprocs):
    with pytest.raises(ValueError, match=re.escape(f"got: {nprocs!r}")):
        distributed.launch(_noop_worker, nprocs=nprocs)


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "RANK set but WORLD_SIZE, LOCAL_RANK not"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "WORLD_SIZE, LOCAL_RANK set but RANK not"),
    ({"RANK": "one", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK must be an integer, got: 'one'"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "rank=2, local_rank=0, world_size=2"),
])
def test_malformed_launcher_environment_is_named(monkeypatch, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises((ValueError, RuntimeError), match=re.escape(message)):
        distributed.launch(_noop_worker)
    with pytest.raises((ValueError, RuntimeError), match=re.escape(message)):
        distributed.init_process_group(0, 1)


def test_init_without_launcher_for_a_world_above_one_says_how_to_start():
    with pytest.raises(ValueError, match="world_size=2 but no launcher environment"):
        distributed.init_process_group(0, 2)


def test_single_process_init_creates_no_group_and_is_idempotent():
    assert distributed.init_process_group(0, 1) == torch.device("cpu")
    assert distributed.init_process_group(0, 1) == torch.device("cpu")
    assert not torch.distributed.is_initialized()


def test_launch_rejects_a_lambda_before_starting_anything():
    with pytest.raises(TypeError, match="cannot be pickled"):
        distributed.launch(lambda rank, world: None, nprocs=2)


@settings(max_examples=examples(10), deadline=None)
@given(n=st.integers(1, 40), world=st.sampled_from([1, 2]), shuffle=st.booleans(), pad=st.booleans(),
       seed=st.integers(0, 3), epoch=st.integers(0, 3), batch=st.integers(1, 5), data=st.data())
def test_set_epoch_skip_continues_the_same_order_and_never_loads_the_skipped(pools, n, world, shuffle, pad, seed,
                                                                                epoch, batch, data):
    share = -(-n // world) if pad else n // world  # the smallest rank's share
    skip = data.draw(st.integers(0, share), label="skip")
    spec = {"n": n, "shuffle": shuffle, "pad": pad, "seed": seed, "epoch": epoch, "skip": skip, "batch": batch}
    if pad and n < world:
        return  # data_sampler refuses it (tested elsewhere)
    for rank, got in enumerate(pools.run(world, task_sampler_skip, spec)):
        assert got["resumed"] == got["whole"][skip:], f"rank {rank}: not the rest of the same order"
        assert got["len"] == len(got["whole"]) - skip
        assert got["loaded"] == got["resumed"], f"rank {rank}: loaded {got['loaded']}, a skipped sample among them"
        assert got["next_len"] == len(got["whole"]), "the next set_epoch must start whole"



class RandomCrops(torch.utils.data.Dataset):
    """A random "crop" per read, from torch's global generator and Python's random, as augmentations draw."""
    classes = ("a", "b")

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> tuple[torch.Tensor, float]:
        return torch.randn(3) + index, random.random()


def test_seeded_dataset_gives_each_sample_one_draw_per_epoch_and_spares_the_callers():
    """seeded_dataset: a sample reads the same however often it is read and whatever the caller's generators
    hold (any rank, worker or resume point), differently in another epoch (set through data_sampler's set_epoch)
    and for another index; the caller's torch and Python generators are left as they were."""
    data = seeded_dataset(RandomCrops(), seed=7)
    sampler = distributed.data_sampler(data, True, shuffle=True)
    torch.manual_seed(0)
    before, python_before = torch.get_rng_state(), random.getstate()
    first = data[2]
    torch.manual_seed(99)
    again = data[2]
    assert torch.equal(first[0], again[0]) and first[1] == again[1]
    assert not torch.equal(data[3][0] - 3, first[0] - 2)
    sampler.set_epoch(1)
    assert not torch.equal(data[2][0], first[0]) and data[2][1] != first[1]
    torch.manual_seed(0)
    data[4]
    assert torch.equal(torch.get_rng_state(), before) and random.getstate() == python_before
    assert len(data) == 6 and data.classes == ("a", "b")
    with pytest.raises(TypeError, match="seed must be an integer, got: 1.5"):
        seeded_dataset(RandomCrops(), 1.5)


def test_seeded_dataset_draws_per_index_alike_in_any_worker_and_resume():
    """Every index of an epoch gets its own draw (torch's and Python's: a seed that ignored the index gave every
    sample of an epoch the same augmentation); the same index gets the same draw in two DataLoader workers and in
    a new wrapper, as a resumed process builds it."""
    data = seeded_dataset(RandomCrops(), seed=7)
    draws = [data[i] for i in range(len(data))]
    noise = [x - i for i, (x, _) in enumerate(draws)]  # RandomCrops adds the index: (r + i) - i is r to rounding
    closest = min((a - b).abs().max().item() for n, a in enumerate(noise) for b in noise[n + 1:])
    assert closest > 1e-3, f"two indices drew the same torch noise (closest pair {closest:.1e} apart)"
    assert len({p for _, p in draws}) == len(data), "two indices drew the same Python random()"
    loader = torch.utils.data.DataLoader(data, batch_size=1, sampler=[3, 3], num_workers=2)
    (x0, p0), (x1, p1) = [(x[0], p.item()) for x, p in loader]  # batch 0 from worker 0, batch 1 from worker 1
    assert torch.equal(x0, x1) and torch.equal(x0, draws[3][0]) and p0 == p1 == draws[3][1]
    resumed = seeded_dataset(RandomCrops(), seed=7)[3]
    assert torch.equal(resumed[0], draws[3][0]) and resumed[1] == draws[3][1]


def test_seeded_dataset_batches_read_as_single_items_and_spare_the_callers():
    """A DataLoader in the main process reads a batch at once (the wrapper's __getitems__, where the caller's
    generators are saved and given back once a batch): each item of a batch equals its single read, with its own
    draw, and the caller's torch and Python streams go on as if no batch had been read."""
    data = seeded_dataset(RandomCrops(), seed=3)
    singles = [data[i] for i in range(len(data))]
    # A generator of its own: iter(loader) draws its workers' base seed, from the global generator otherwise.
    loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=list, generator=torch.Generator())
    torch.manual_seed(5)
    random.seed(5)
    expected = torch.rand(2), random.random()
    torch.manual_seed(5)
    random.seed(5)
    batches = list(loader)
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1], "the caller's streams moved"
    assert [len(batch) for batch in batches] == [4, 2]
    for index, (x, p) in enumerate(batches[0] + batches[1]):
        assert torch.equal(x, singles[index][0]) and p == singles[index][1], f"item {index} read otherwise in a batch"


class OwnsAGenerator(torch.utils.data.Dataset):
    """A dataset that draws from a generator of its own, as albumentations >= 1.4.21 and MONAI do; per_sample=True
    seeds it per item from torch.initial_seed(), as seeded_dataset's docstring shows."""

    def __init__(self, per_sample: bool):
        self.gen, self.per_sample = torch.Generator().manual_seed(0), per_sample

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.per_sample:
            self.gen.manual_seed(torch.initial_seed())  # the item's seed, under seeded_dataset
        return torch.rand(2, generator=self.gen) + index


def test_a_generator_the_dataset_owns_is_named_and_reached_per_sample():
    """seeded_dataset cannot reseed a generator the dataset owns: check_repeatable names that (and a plain
    dataset's global draws, with the wrapper as the fix); seeded from torch.initial_seed() per item, it repeats."""
    with pytest.raises(ValueError, match=r"item 0 differs between two reads: your dataset draws from a generator "
                                         r"seeded_dataset does not reseed .*torch.initial_seed\(\)"):
        distributed.check_repeatable(seeded_dataset(OwnsAGenerator(per_sample=False)))
    with pytest.raises(ValueError, match=r"item 3 differs between two reads: the data's items change .*Wrap the "
                                         r"dataset with seeded_dataset\(data, seed\) \(`from seeded_dataset import "
                                         r"seeded_dataset`"):
        distributed.check_repeatable(RandomCrops(), indices=[3])
    data = seeded_dataset(OwnsAGenerator(per_sample=True), seed=5)
    distributed.check_repeatable(data, indices=range(8))
    assert not torch.equal(data[1] - 1, data[2] - 2)


class NumpyNoise(torch.utils.data.Dataset):
    """Augments with numpy's global generator (imported only by the tests that use it)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        import numpy
        return torch.tensor(numpy.random.rand(3)) + index


def seat_pcg64(worker_id: int) -> None:
    """A worker_init_fn giving a loader worker numpy's recommended PCG64 as its global bit generator."""
    import numpy
    numpy.random.set_bit_generator(numpy.random.PCG64(worker_id))


def test_seeded_dataset_seeds_numpy_where_imported_and_restores_the_callers():
    """A dataset augmenting with numpy's global generator (older albumentations, imgaug, many users' own): each item
    reads the same twice, in a loader worker, in the process and in a batch, and the caller's numpy stream goes on
    untouched."""
    np = pytest.importorskip("numpy")
    data = seeded_dataset(NumpyNoise(), seed=2)
    np.random.seed(11)
    expected = np.random.rand(2)
    np.random.seed(11)
    first = data[1]
    caller = np.random.rand(2)
    assert (caller == expected).all(), "the caller's numpy stream moved"
    if hasattr(np.random, "get_bit_generator"):  # numpy >= 1.24, where a read swaps generators instead of copying
        bits = np.random.get_bit_generator()
        data[3]
        assert np.random.get_bit_generator() is bits, "the caller's numpy generator was replaced"
    assert torch.equal(first, data[1]) and not torch.equal(data[1] - 1, data[2] - 2)
    loader = torch.utils.data.DataLoader(data, batch_size=1, sampler=[1, 1], num_workers=2)
    assert all(torch.equal(batch[0], first) for batch in loader)
    np.random.seed(11)
    batch = next(iter(torch.utils.data.DataLoader(data, batch_size=4, collate_fn=list, generator=torch.Generator())))
    assert (np.random.rand(2) == expected).all(), "a batch read moved the caller's numpy stream"
    assert all(torch.equal(item, data[index]) for index, item in enumerate(batch)), "a batch read otherwise"


def test_seeded_dataset_numpy_draws_ignore_which_global_bit_generator_is_seated():
    """A PCG64 seated as numpy's global generator (a worker_init_fn, or the main process): items read the same as
    under the default MT19937. Before, a worker reseeded the PCG64 and drew other numbers than the main process."""
    np = pytest.importorskip("numpy")
    if not hasattr(np.random, "set_bit_generator"):
        pytest.skip(f"numpy {np.__version__} has no set_bit_generator (added in 1.24): its global is always MT19937")
    data = seeded_dataset(NumpyNoise(), seed=4)
    expected = [data[i] for i in range(4)]
    callers = np.random.get_bit_generator()
    try:
        np.random.set_bit_generator(np.random.PCG64(1))
        assert all(torch.equal(data[i], expected[i]) for i in range(4)), "the main process drew otherwise"
    finally:
        np.random.set_bit_generator(callers)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2, worker_init_fn=seat_pcg64)
    assert all(torch.equal(item, expected[i]) for i, item in enumerate(loader)), "a PCG64 worker drew otherwise"


def test_an_iterable_dataset_is_refused_naming_how_to_shard_or_seed_it():
    """data_sampler and seeded_dataset have indices to work with; a stream has none: each says what to do."""
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    with pytest.raises(TypeError, match=r"data_sampler: got an IterableDataset \(Stream\).*sharded_stream\(shards, "
                                        r"read, \.\.\.\).*stop_together\(loader\)"):
        distributed.data_sampler(Stream(), True, True)
    with pytest.raises(TypeError, match=r"seeded_dataset: got an IterableDataset \(Stream\).*sharded_stream\(shards, "
                                        r"read, transform=\.\.\.\).*record's key.*stop_together\(loader\)"):
        seeded_dataset(Stream())


def test_sync_batchnorm_converts_in_place_keeping_weights_buffers_and_mode():
    """Every BatchNorm at any depth converted, its Parameters the same objects (an optimizer holding them keeps
    working), its buffers and eval/train flag kept; in a world of one it computes exactly what BatchNorm does;
    a model without BatchNorm comes back unchanged."""
    plain = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.BatchNorm1d(4), nn.ReLU()), nn.BatchNorm1d(4))
    plain[1][0].running_mean.fill_(0.5)
    plain[2].eval()
    weight, reference = plain[1][0].weight, copy.deepcopy(plain)
    model = sync_batchnorm(plain)
    assert model is plain and model[1][0].weight is weight
    assert torch.equal(model[1][0].running_mean, 0.5 * torch.ones(4))
    assert getattr(model[1][0], "synchronized", False) and not model[2].training and model[1][0].training
    x = torch.randn(6, 3)
    assert torch.equal(model(x), reference(x))
    assert torch.equal(model[1][0].running_var, reference[1][0].running_var)
    no_batchnorm = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    children = list(no_batchnorm.children())
    assert sync_batchnorm(no_batchnorm) is no_batchnorm and list(no_batchnorm.children()) == children


def task_sync_batchnorm_edges(spec: dict) -> dict:
    rank, out = distributed.get_rank(), {}
    try:
        sync_batchnorm(DDP(nn.Linear(2, 2)))
    except TypeError as e:
        out["ddp"] = str(e)
    x = torch.arange(3, dtype=torch.float64).reshape(1, 3) + rank  # one sample per rank
    out["one each"] = sync_batchnorm(nn.BatchNorm1d(3).double())(x).detach()
    alone = sync_batchnorm(nn.BatchNorm1d(3).double())
    try:
        alone(x if rank == 0 else x[:0])  # rank 1 holds no sample: the global batch is one sample
        out["alone"] = "no error"
    except ValueError as e:
        out["alone"] = str(e)
    return out


def test_sync_batchnorm_edges_on_two_ranks(pools):
    """One sample per rank trains (the global batch has two: plain BatchNorm would refuse each rank's one) and
    equals BatchNorm on the two; a global batch of one value per channel is BatchNorm's error with the global
    count; a model already in DDP is refused, naming the order."""
    results = pools.run(2, task_sync_batchnorm_edges, {})
    both = nn.BatchNorm1d(3).double()(torch.arange(3, dtype=torch.float64).reshape(1, 3) + torch.tensor([[0.], [1.]]))
    for rank, found in enumerate(results):
        assert "convert first, then wrap: DDP(sync_batchnorm(model))" in found["ddp"]
        torch.testing.assert_close(found["one each"], both[rank:rank + 1], rtol=1e-12, atol=1e-12)
        assert "Expected more than 1 value per channel when training" in found["alone"], found["alone"]
        assert "1 value(s) per channel in the global batch" in found["alone"]


def task_sync_batchnorm_cpu_model_and_eval(spec: dict) -> dict:
    rank, out = distributed.get_rank(), {}
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # a GPU process whose model stays on the CPU (nothing touches CUDA here)
    try:
        model = sync_batchnorm(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))).double()
    finally:
        torch.cuda.is_available = available
    out["torch's"] = isinstance(model[1], nn.SyncBatchNorm)
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3) + rank
    DDP(model)(x).sum().backward()  # torch's SyncBatchNorm in a CPU module: DDP refuses it, its forward too
    out["grad"] = model[0].weight.grad.clone()
    untracked = sync_batchnorm(nn.BatchNorm1d(3, track_running_stats=False).double()).eval()
    if rank == 0:  # an evaluation on the primary alone, as torch's SyncBatchNorm allows in eval
        out["eval"] = untracked(x).detach()
    return out


def test_sync_batchnorm_picks_by_device_and_evaluates_on_one_rank(pools):
    """In a process where CUDA is available but the model is kept on the CPU, the layer is the exact one (torch's
    SyncBatchNorm is refused there: by DDP at wrap, by its forward); in eval without running statistics a layer
    normalizes the local batch, never waiting for the other ranks, as torch's does: the primary alone evaluates."""
    results = pools.run(2, task_sync_batchnorm_cpu_model_and_eval, {})
    assert [found["torch's"] for found in results] == [False, False]
    assert torch.equal(results[0]["grad"], results[1]["grad"])
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    torch.testing.assert_close(results[0]["eval"], nn.BatchNorm1d(3, track_running_stats=False).double()(x))


def task_sync_batchnorm_bf16(spec: dict) -> tuple[torch.Tensor, torch.Tensor]:
    rank = distributed.get_rank()
    x = 100 + torch.randn(1201, 3, generator=torch.Generator().manual_seed(rank))  # a mean far from 0
    layer = sync_batchnorm(nn.BatchNorm1d(3))
    return layer(x.to(torch.bfloat16)).detach(), layer.running_mean.clone()


def test_sync_batchnorm_of_bf16_input_keeps_float32_statistics(pools):
    """bf16 input, as under CPU autocast (ddp_check's mixed_precision): the statistics are float32, as BatchNorm's
    kernels keep them, and the output is bf16 like the input. Summed in bf16, a global batch of mean 100 lost its
    mean (outputs 0.79 off) and a count above 256 was not exact."""
    both = torch.cat([100 + torch.randn(1201, 3, generator=torch.Generator().manual_seed(r)) for r in range(2)])
    reference = nn.BatchNorm1d(3)
    expected = reference(both.to(torch.bfloat16).float())
    for rank, (out, running_mean) in enumerate(pools.run(2, task_sync_batchnorm_bf16, {})):
        assert out.dtype == torch.bfloat16
        # 0.03: bf16's rounding of standardized outputs up to about 4 (its spacing there is 2^-6 = 0.016)
        torch.testing.assert_close(out.float(), expected[rank * 1201:(rank + 1) * 1201], rtol=0, atol=0.03)
        torch.testing.assert_close(running_mean, reference.running_mean, rtol=1e-6, atol=1e-6)


def test_set_epoch_skip_beyond_this_ranks_share_is_an_error_naming_it():
    sampler = distributed.data_sampler(list(range(10)), True, shuffle=True)
    with pytest.raises(ValueError, match=r"skip must be between 0 and this rank's share of 10 samples, got: 11"):
        sampler.set_epoch(0, skip=11)

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

import json
import math
import os
import re
import signal
import subprocess
import sys
import uuid

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

import distributed
import min_ddp_cli
from harness import (CLASSES, FEATURES, HERE, build_data, build_model, check_training, examples, grad_vector,
                      leftover_processes, loss_fn, one_thread, run_min_ddp, run_script, task_all_gather, task_eval,
                      task_grads,
                      task_identity, task_reduce, task_sampler, task_wire_contiguity)

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
       lr=st.sampled_from([0.01, 0.1]), model_seed=seeds, data_seed=seeds, shuffle=st.booleans(),
       epoch=st.integers(0, 3), extra=st.integers(0, 5), allreduce=allreduces)
def test_n_process_params_equal_one_process_after_every_step(world, kind, width, batch, steps,
                                                              optim, lr, model_seed, data_seed, shuffle,
                                                              epoch, extra, allreduce):
    """Through ddp_check's engine (the harness users get): the first step's gradients, then the
    parameters and buffers after every step, replicas bitwise equal, rank 0 within RTOL of one process."""
    spec = {"kind": kind, "width": width, "batch": batch, "steps": steps, "optim": optim, "lr": lr,
            "model_seed": model_seed, "data_seed": data_seed, "shuffle": shuffle, "epoch": epoch,
            "accum": 1, "n": steps * batch * world + extra, "allreduce": allreduce}
    first_step = check_training(spec, world, RTOL)[0]["states"][0]
    initial = build_model(kind, width, model_seed).state_dict()
    assert max((first_step[k] - v).abs().max() for k, v in initial.items()) > 1e-6, "the step must change the model"


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
    spec = {"kind": kind, "width": 4, "batch": batch, "steps": steps, "optim": optim, "lr": 0.1,
            "model_seed": model_seed, "data_seed": data_seed, "shuffle": True, "epoch": 0,
            "accum": accum, "n": steps * accum * batch * world, "allreduce": allreduce}
    results = check_training(spec, world, RTOL)

    # Micro-steps stay local: after the first micro-batch each rank holds its own gradient only.
    order = list(distributed.data_sampler(build_data(kind, spec["n"], data_seed), True, True, seed=data_seed))
    first = [torch.cat([g.flatten() for g in res["first_micro_grads"].values()]) for res in results]
    for rank, grad in enumerate(first):
        local = local_gradient(spec, order[rank::world][:batch]) / accum
        torch.testing.assert_close(grad, local, rtol=RTOL, atol=1e-12)
    spread = (first[0] - first[1]).abs().max()
    assert spread > 1e-4, f"ranks' micro-step gradients should differ (local, not averaged): {spread}"


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
            moved = sum(x != y for x, y in zip(orders[a], orders[b]))
            assert moved >= 0.8 * len(orders[a]), f"epochs {a} and {b} share too much order ({moved} moved)"
    assert orders[3] == orders[0], "set_epoch(0) again must give epoch 0's order"


def test_padded_sampler_would_count_duplicates_in_evaluation(pools):
    """Why evaluation uses pad=False: padding makes 10 samples count as 12 across 3 ranks."""
    padded = pools.run(3, task_sampler, {"n": 10, "shuffle": False, "pad": True, "seed": 0, "epochs": [0]})
    exact = pools.run(3, task_sampler, {"n": 10, "shuffle": False, "pad": False, "seed": 0, "epochs": [0]})
    assert sum(len(r[0]) for r in padded) == 12
    assert sum(len(r[0]) for r in exact) == 10


def test_data_sampler_is_none_when_not_distributed():
    assert distributed.data_sampler(TensorDataset(torch.arange(5)), False, True) is None


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


def test_collectives_hand_torch_distributed_contiguous_tensors_whatever_the_input(pools):
    """`reduce(x.T)` and `all_gather(preds[:, 0])` are strided views: NCCL raises "Tensors must be contiguous"
    on them, on GPUs only, because gloo takes them. What goes on the wire must be contiguous."""
    for rank, got in enumerate(pools.run(2, task_wire_contiguity, {})):
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


def test_the_cpu_suite_hides_the_gpus_from_itself_and_every_process_it_starts():
    """Where GPUs are visible, the suite's ranks would take nccl and `--nprocs 2` would be refused on one GPU:
    conftest.py hides them (CUDA_VISIBLE_DEVICES=) from pytest and every process it starts."""
    child = run_script(["-c", "import os, torch; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), "
                              "torch.cuda.is_available())"], timeout=60)
    assert child.stdout.split() == ["''", "False"], child.stderr


def test_the_gpu_tests_run_only_when_asked_for_and_then_alone():
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                               cwd=HERE, capture_output=True, text=True, timeout=120, env={**os.environ, "DDP_GPU_TESTS": "1"})
    assert {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line} == {"test_gpu.py"}, \
        collected.stdout[-2000:]


def test_helpers_behave_as_one_process_before_init():
    assert (distributed.get_rank(), distributed.get_world_size(), distributed.is_primary()) == (0, 1, True)
    assert distributed.launch_mode() == "single"
    distributed.barrier()
    distributed.cleanup()
    distributed.cleanup()


def test_min_ddp_two_processes_through_launch_reaches_90_percent(tmp_path):
    marker = f"DDP_TEST_MARKER={uuid.uuid4().hex}"
    key, value = marker.split("=")
    out = run_script(["min_ddp.py", "--nprocs", "2", "--epochs", "2", "--log-every", "64"], env={key: value})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("mode=spawn world=2 backend=gloo allreduce=shared-memory device=cpu")
    assert any(line.startswith("[rank 0] epoch 1 step 64/128") for line in lines)
    assert any(line.startswith("[rank 1] epoch 1 step 64/128") for line in lines)
    assert any(line.startswith("[global] epoch 1 step 64/128") for line in lines)
    done = dict(kv.split("=") for kv in lines[-1].removeprefix("done: ").split())
    assert lines[-1].startswith("done: ") and done["world"] == "2" and done["epochs"] == "2"
    # Both count every rank's training samples: the run's rate, a little later than the last epoch's line.
    last_epoch_rate = float(re.findall(r"\| (\d+) samples/s", out.stdout)[-1])
    assert float(done["val_acc"]) >= 0.90 and 0.5 * last_epoch_rate <= float(done["samples_per_s"]) <= last_epoch_rate
    assert {"train_loss", "val_loss"} <= done.keys()
    assert "NumPy" not in out.stderr, out.stderr  # torch's notice that numpy is missing, in any process
    assert leftover_processes(marker) == []


PRINT_RANKED = """
import sys
import distributed as dist

def worker(local_rank, world_size):
    dist.init_process_group(local_rank, world_size)
    dist.print_ranked("é" * dist.get_rank(), "line", dist.get_rank(), sep="|")  # lines of unequal length
    dist.cleanup()

if __name__ == "__main__":
    dist.launch(worker, nprocs=int(sys.argv[1]))
"""


def without_numpy(tmp_path) -> dict:
    """An environment whose interpreters, spawned ranks included, fail to `import numpy`, as on a
    machine where only requirements.txt is installed (torch does not depend on numpy)."""
    site = tmp_path / "no-numpy"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["numpy"] = None\n')
    return {"PYTHONPATH": os.pathsep.join([str(site), HERE])}


@pytest.mark.parametrize("world", [1, 3])
def test_print_ranked_prints_one_line_per_rank_in_rank_order_without_numpy(tmp_path, world):
    script = tmp_path / "ranked.py"
    script.write_text(PRINT_RANKED)
    out = run_script([str(script), str(world)], timeout=120, env=without_numpy(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"[rank {r}] {'é' * r}|line|{r}" for r in range(world)]


def test_min_ddp_saves_and_resumes_on_two_processes_without_numpy(tmp_path):
    """The quick start with --snapshot, in interpreters where numpy cannot be imported: every
    collective (the shared-memory set-up, save_checkpoint, the metrics) must travel as tensors."""
    env = without_numpy(tmp_path)
    check = run_script(["-c", "import numpy"], env=env)
    assert check.returncode != 0, "the sitecustomize must hide numpy"
    snapshot = tmp_path / "s.pt"
    flags = ["--nprocs", "2", "--snapshot", str(snapshot), "--log-every", "8"]
    first = run_min_ddp(tmp_path, *flags, "--epochs", "1", TRAIN_SIZE="2048", **env)
    assert first.returncode == 0, first.stderr
    assert "allreduce=shared-memory" in first.stdout and "done: world=2 epochs=1" in first.stdout
    second = run_min_ddp(tmp_path, *flags, "--epochs", "2", TRAIN_SIZE="2048", **env)
    assert second.returncode == 0, second.stderr
    assert f"resumed from {snapshot} after 1 epoch(s)" in second.stdout
    assert "epoch 2/2" in second.stdout and "done: world=2 epochs=2" in second.stdout


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


@pytest.mark.parametrize("flag, value", [("--batch-size", "0"), ("--epochs", "-1"), ("--nprocs", "0"),
                                         ("--lr", "0"), ("--timeout", "0"), ("--train-size", "0")])
def test_min_ddp_rejects_non_positive_settings(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        min_ddp_cli.parse_args([flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"got: {value}" in err and flag in err, err


@pytest.mark.parametrize("nprocs, gpus, refused", [(2, 1, True), (4, 2, True), (2, 2, False), (None, 1, False),
                                                   (2, 0, False)])
def test_min_ddp_more_processes_than_gpus_is_one_line_naming_both_ways_out(nprocs, gpus, refused):
    """On a 1-GPU machine `--nprocs 2` was a ValueError traceback from launch(); parse_args says it in one line."""
    problem = min_ddp_cli.too_many_processes(nprocs, gpus)
    assert (problem is not None) == refused
    assert not refused or (f"--nprocs {nprocs} but {gpus} GPU(s) are visible" in problem and "`python min_ddp.py`"
                           in problem and f"`CUDA_VISIBLE_DEVICES= python min_ddp.py --nprocs {nprocs}`" in problem)


def test_min_ddp_config_file_and_flags_override(tmp_path):
    config = tmp_path / "cfg.json"
    config.write_text('{"epochs": 3, "lr": 0.5, "batch_size": 16}')
    args = min_ddp_cli.parse_args(["--config", str(config), "--lr", "0.25"])
    assert (args.epochs, args.lr, args.batch_size) == (3, 0.25, 16)


@pytest.mark.parametrize("content, message", [
    ('{"epoch": 3}', "--config {}: expected a JSON object whose keys are among: nprocs, epochs, batch_size,"),
    ('[3]', "--config {}: expected a JSON object whose keys are among: nprocs, epochs, batch_size,"),
    ('{"lr": ', "--config {}: Expecting value: line 1 column 8"),
    ('{"lr": "fast"}', "argument --lr: invalid float value: 'fast'"),
    ('{"epochs": 0}', "--epochs must be > 0, got: 0"),
])
def test_min_ddp_config_errors_name_the_file_or_the_flag(tmp_path, capsys, content, message):
    config = tmp_path / "cfg.json"
    config.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        min_ddp_cli.parse_args(["--config", str(config)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message.format(config) in err.strip().splitlines()[-1], err  # one line


def test_min_ddp_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        min_ddp_cli.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "per process (default: 64)" in help_text and "(default: 0.01)" in help_text


def test_min_ddp_settings_it_cannot_use_are_one_line_without_a_traceback(tmp_path):
    """A batch larger than a rank's share: the launcher re-raises the rank's SettingsError as itself (a class
    from the script), and min_ddp prints it in one line (a refused resume: test_snapshot.py). A snapshot that
    has every epoch already reports its model and no speed."""
    too_big = run_min_ddp(tmp_path, "--nprocs", "2", "--batch-size", "1025", TRAIN_SIZE="2048")
    assert too_big.returncode == 1 and "Traceback" not in too_big.stderr, too_big.stderr
    assert too_big.stderr.strip().splitlines()[-1].startswith("min_ddp: --batch-size 1025 is more than each "
                                                               "process's share of the training data (1024 samples")
    snapshot = str(tmp_path / "s.pt")
    assert run_min_ddp(tmp_path, "--epochs", "1", "--snapshot", snapshot, TRAIN_SIZE="2048").returncode == 0
    nothing_left = run_min_ddp(tmp_path, "--epochs", "1", "--snapshot", snapshot, TRAIN_SIZE="2048")
    done = nothing_left.stdout.splitlines()[-1]
    assert done.startswith("done: world=1 epochs=1") and "samples_per_s" not in done, nothing_left.stdout


def test_min_ddp_ctrl_c_is_one_line_and_exit_code_130():
    proc = subprocess.Popen([sys.executable, "min_ddp.py", "--nprocs", "2", "--epochs", "100"], cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().startswith("mode=spawn")  # the workers are training
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does: the whole foreground group
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err == "min_ddp: interrupted\n", err


def test_min_ddp_print_config_writes_a_config_that_reads_back_as_the_same_settings(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        min_ddp_cli.parse_args(["--print-config", "--epochs", "3", "--lr", "0.5", "--snapshot", str(tmp_path / "s.pt")])
    assert exit_.value.code == 0
    config = tmp_path / "cfg.json"
    config.write_text(capsys.readouterr().out)
    assert min_ddp_cli.parse_args(["--config", str(config)]) == min_ddp_cli.parse_args(
        ["--config", str(config), "--epochs", "3", "--lr", "0.5", "--snapshot", str(tmp_path / "s.pt")])
    assert json.loads(config.read_text())["epochs"] == 3


def test_min_ddp_checks_a_config_files_values_as_flags(tmp_path, capsys):
    config = tmp_path / "cfg.json"
    config.write_text('{"lr": -1}')
    with pytest.raises(SystemExit):
        min_ddp_cli.parse_args(["--config", str(config)])
    assert "--lr must be > 0, got: -1.0" in capsys.readouterr().err  # checked as the flag would be


@pytest.mark.parametrize("source", ["flag", "config"])
@pytest.mark.parametrize("flag", ["--snapshot", "--save-model"])
def test_min_ddp_refuses_an_unwritable_output_path_before_training(tmp_path, capsys, flag, source):
    path = str(tmp_path / "no" / "such" / "out.pt")
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({flag[2:].replace("-", "_"): path}))
    with pytest.raises(SystemExit) as exit_:
        min_ddp_cli.parse_args([flag, path] if source == "flag" else ["--config", str(config)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"argument {flag}: {path} is a directory, or {os.path.dirname(path)} is missing or read-only" in err, err


@pytest.mark.parametrize("flag", ["--snapshot", "--save-model"])
def test_min_ddp_refuses_a_directory_as_an_output_file_before_training(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exit_:
        min_ddp_cli.parse_args([flag, str(tmp_path)])
    assert exit_.value.code == 2
    assert f"argument {flag}: {tmp_path} is a directory, or" in capsys.readouterr().err

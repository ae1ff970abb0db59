"""ddp_check.assert_ddp_equivalent: passes on correct models, fails naming the cause on each trap.

Every model, dataset and loss here is a top-level function, as the check requires: the ranks are
real gloo processes (the pools shared with the rest of the suite) that import them by name.
"""
from __future__ import annotations

import functools
import re
import textwrap
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ddp_check
import distributed
from conftest import HERE, leftover_processes, run_script
from ddp_check import assert_ddp_equivalent

N = 64  # samples: more than max(world_sizes) x batch_size x steps = 3 x 4 x 3


def images() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 1, 6, 6, generator=gen), torch.randint(3, (N,), generator=gen))


def vectors() -> TensorDataset:
    gen = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(N, 5, generator=gen), torch.randint(3, (N,), generator=gen))


def sequences() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, 7, 4, generator=gen), torch.randint(3, (N,), generator=gen))


def dict_vectors() -> list[dict]:
    x, y = vectors().tensors
    return [{"x": x[i], "y": y[i]} for i in range(N)]


def convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3))


class GRUClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru, self.head = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x)[0][:, -1])


def gru() -> nn.Module:
    return GRUClassifier()


class TransformerClassifier(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.block = nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=16, dropout=dropout, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.proj(x)).mean(1))


def transformer() -> nn.Module:
    return TransformerClassifier()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def batchnorm_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def dropout_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3))


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def with_unused() -> nn.Module:
    return WithUnused()


class CountsItsData(nn.Module):
    """Adds to a parameter, outside autograd, what this rank's data says: replicas drift apart."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.linear.bias.add_(1e-2 * x.mean())
        return self.linear(x)


def counts_its_data() -> nn.Module:
    return CountsItsData()


class SlowOnRankOne(nn.Module):
    """Rank 1's forward takes 30 s: a hang, for a check with a shorter timeout."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if distributed.get_rank() == 1:
            time.sleep(30)
        return self.linear(x)


def slow_on_rank_one() -> nn.Module:
    return SlowOnRankOne()


def cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def summed_cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum")


def dict_cross_entropy(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def momentum(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# ---------------------------------------------------------------------------------------------
# Correct models pass
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_model, make_data, optimizer", [
    (convnet, images, None), (gru, sequences, momentum), (transformer, sequences, adam)])
def test_correct_models_pass(make_model, make_data, optimizer):
    assert_ddp_equivalent(make_model, make_data, cross_entropy, make_optimizer=optimizer)


def test_dict_batches_and_other_world_sizes_pass():
    assert_ddp_equivalent(mlp, dict_vectors, dict_cross_entropy, world_sizes=(1, 4), steps=2, batch_size=3)


# ---------------------------------------------------------------------------------------------
# Each cause fails with its name in the message
# ---------------------------------------------------------------------------------------------


def failure(*args, **kwargs) -> str:
    with pytest.raises(AssertionError) as info:
        assert_ddp_equivalent(*args, **kwargs)
    return str(info.value)


def test_batchnorm_is_named_with_its_module_and_type():
    message = failure(batchnorm_mlp, vectors, cross_entropy, world_sizes=(2,))
    assert "world size 2, step 1, the gradient of `" in message
    assert "BatchNorm module `1` (BatchNorm1d)" in message and "SyncBatchNorm" in message
    assert "GroupNorm/LayerNorm" in message


def test_dropout_is_named_with_its_probability():
    message = failure(dropout_mlp, vectors, cross_entropy, world_sizes=(2,))
    assert "Dropout module `1` (Dropout) with p=0.5" in message and "disable dropout" in message


def test_dropout_inside_a_transformer_block_is_named():
    message = failure(functools.partial(TransformerClassifier, 0.3), sequences, cross_entropy, world_sizes=(2,))
    assert "`block.dropout` (Dropout) with p=0.3" in message


@pytest.mark.parametrize("world", [2, 3])
def test_summed_loss_is_named_as_a_world_size_factor(world):
    message = failure(mlp, vectors, summed_cross_entropy, world_sizes=(world,))
    assert f"world size {world}, step 1, the gradient of `0.weight`" in message
    assert f"about 1/{world} (the world size)" in message and "batch mean" in message
    errors = re.search(r"largest absolute error (\S+), largest relative error (\S+)", message)
    assert float(errors.group(2)) == pytest.approx(1 - 1 / world, rel=1e-3)  # printed to 3 digits


def test_unused_parameters_point_to_find_unused_parameters():
    message = failure(with_unused, vectors, cross_entropy, world_sizes=(2,))
    assert "world size 2" in message and "find_unused_parameters=True" in message


def test_replicas_that_drift_apart_are_named():
    message = failure(counts_its_data, vectors, cross_entropy, world_sizes=(2,))
    assert "world size 2, step 1, `linear.bias` after the optimizer step (rank 1 differs from rank 0)" in message
    assert "replicas that differ from each other" in message


def test_the_first_diverging_tensor_is_named_in_parameter_order():
    """BatchNorm changes every gradient; the report names the first parameter, `0.weight`."""
    message = failure(batchnorm_mlp, vectors, cross_entropy, world_sizes=(3,), steps=1)
    assert re.search(r"world size 3, step 1, the gradient of `0\.weight`", message), message


def test_a_hung_rank_fails_the_call_after_the_timeout_and_the_next_call_works(monkeypatch):
    monkeypatch.setattr(ddp_check, "TIMEOUT_S", 3.0)
    message = failure(slow_on_rank_one, vectors, cross_entropy, world_sizes=(2,))
    assert "world size 2" in message and "did not finish within 3 s on ranks [0, 1]" in message
    monkeypatch.undo()
    assert_ddp_equivalent(mlp, vectors, cross_entropy, world_sizes=(2,))  # a new pool: the hung one was stopped


def task_where_the_pool_runs(spec: dict) -> tuple:
    import os
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.distributed.get_backend(), torch.cuda.device_count()


def test_pool_workers_are_gloo_cpu_processes_even_where_gpus_are_visible():
    """Without this, on a GPU machine the pools got nccl: two ranks on one GPU ("Duplicate GPU detected"),
    or a CPU model wrapped by DDP on an nccl group. The check compares CPU processes, as the README says."""
    ranks = ddp_check.worker_pools().run(2, task_where_the_pool_runs, {})
    assert ranks == [("", "gloo", 0)] * 2


# ---------------------------------------------------------------------------------------------
# Bad input fails before any process starts
# ---------------------------------------------------------------------------------------------


def test_lambda_is_rejected_naming_the_argument():
    with pytest.raises(ValueError, match=r"make_model must be a top-level function.*<lambda>.*`def`"):
        assert_ddp_equivalent(lambda: mlp(), vectors, cross_entropy)


def test_nested_function_is_rejected_naming_the_argument():
    def loss(model, batch):
        return cross_entropy(model, batch)
    with pytest.raises(ValueError, match=r"loss_fn must be a top-level function.*<locals>"):
        assert_ddp_equivalent(mlp, vectors, loss)


def not_a_module():
    return mlp().state_dict()


def test_make_model_that_returns_no_module_is_rejected():
    with pytest.raises(TypeError, match=r"make_model\(\) must return a torch.nn.Module, got: OrderedDict"):
        assert_ddp_equivalent(not_a_module, vectors, cross_entropy)


def small_data() -> TensorDataset:
    return TensorDataset(torch.randn(10, 5), torch.zeros(10, dtype=torch.long))


def test_dataset_smaller_than_the_ranks_need_is_rejected():
    with pytest.raises(ValueError, match=r"returned 10 samples.*= 36"):
        assert_ddp_equivalent(mlp, small_data, cross_entropy)


# ---------------------------------------------------------------------------------------------
# From a plain script: pools reused, nothing left behind
# ---------------------------------------------------------------------------------------------

SCRIPT = textwrap.dedent('''
    import sys
    sys.path.insert(0, {repo!r})
    import torch, torch.nn as nn, torch.nn.functional as F
    from torch.utils.data import TensorDataset
    from ddp_check import assert_ddp_equivalent

    def make_model():
        return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))

    def make_data():
        return TensorDataset(torch.randn(48, 5, generator=torch.Generator().manual_seed(0)),
                             torch.arange(48) % 3)

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y, reduction=sys.argv[1])

    if __name__ == "__main__":
        for _ in range(2):  # the second call reuses the pools
            try:
                assert_ddp_equivalent(make_model, make_data, loss_fn)
                print("equivalent")
            except AssertionError as e:
                print("diverges:", str(e).splitlines()[0])
''')


@pytest.mark.parametrize("reduction, expected", [("mean", "equivalent"), ("sum", "diverges: DDP diverges")])
def test_check_runs_from_a_plain_script_and_leaves_no_process(tmp_path, reduction, expected):
    script = tmp_path / "check_mine.py"
    script.write_text(SCRIPT.format(repo=HERE))
    marker = f"DDP_CHECK_{reduction}_{tmp_path.name}"
    out = run_script([str(script), reduction], timeout=180, env={marker: "1"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith(expected) for line in lines), out.stdout
    assert leftover_processes(marker) == []

"""ddp_check.assert_ddp_equivalent: passes on correct models, fails naming the cause on each trap.

Every model, dataset and loss here is a top-level function, as the check requires: the ranks are
real gloo processes (the pools shared with the rest of the suite) that import them by name.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ddp_check
import distributed
from seeded_dataset import seeded_dataset
from sync_batchnorm import sync_batchnorm
from harness import SCRIPTS, leftover_processes, run
from ddp_check import assert_ddp_equivalent, assert_step_equivalent

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


class Augmented(torch.utils.data.Dataset):
    """vectors() with a random augmentation drawn from torch's global generator, as torchvision's transforms draw."""

    def __init__(self):
        self.data = vectors()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[index]
        return x + 0.3 * torch.randn(x.shape), y


def augmented() -> Augmented:
    return Augmented()


def seeded_augmented() -> torch.utils.data.Dataset:
    return seeded_dataset(Augmented(), seed=5)


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


class TalliesItsInputs(nn.Module):
    """A buffer that sums the inputs it saw and never touches the output: under DDP the parameters
    agree with one process, and only the buffers show that the replicas do not."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 3)
        self.register_buffer("seen", torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += x.detach().sum(0)
        return self.linear(x)


def tallies_its_inputs() -> nn.Module:
    return TalliesItsInputs()


class DivergesAtTheThirdStep(nn.Module):
    """Under DDP only, its third forward is 0.1% off: only a check of every step sees it (steps=3)."""

    def __init__(self):
        super().__init__()
        self.linear, self.calls = nn.Linear(5, 3), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        off = self.calls == 3 and distributed.get_world_size() > 1
        return self.linear(x) * (1.001 if off else 1.0)


def diverges_at_the_third_step() -> nn.Module:
    return DivergesAtTheThirdStep()


def deep_batchnorm() -> nn.Module:
    """20 BatchNorm layers, as resnet18 has."""
    return nn.Sequential(*[m for _ in range(20) for m in (nn.Linear(5, 5), nn.BatchNorm1d(5))], nn.Linear(5, 3))


class AttentionDropoutOnly(nn.Module):
    """Dropout inside nn.MultiheadAttention only (a float attribute, no nn.Dropout module)."""

    def __init__(self):
        super().__init__()
        self.attention, self.head = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attention(x, x, x)[0].mean(1))


def attention_dropout_only() -> nn.Module:
    return AttentionDropoutOnly()


def gpt_like() -> nn.Module:
    """Two pre-norm transformer blocks with dropout 0.1 everywhere, as GPT-2 has by default."""
    return nn.Sequential(nn.Linear(4, 8), nn.TransformerEncoder(nn.TransformerEncoderLayer(
        8, nhead=2, dim_feedforward=16, dropout=0.1, batch_first=True, norm_first=True), 2,
        enable_nested_tensor=False), nn.Flatten(),
        nn.Linear(56, 3))


def cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def scaled_under_ddp(factor: float, model: nn.Module, batch) -> torch.Tensor:
    """The loss times ``factor`` on the ranks only: a divergence of exactly that relative size."""
    return cross_entropy(model, batch) * (factor if distributed.get_world_size() > 1 else 1.0)


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
    assert "BatchNorm in `1` (BatchNorm1d) normalizes" in message and "sync_batchnorm(model)" in message
    assert "GroupNorm/LayerNorm" in message


def synced_batchnorm_mlp() -> nn.Module:
    """BatchNorm1d, affine, tracking running statistics (momentum 0.1)."""
    return sync_batchnorm(batchnorm_mlp())


def synced_batchnorm_conv() -> nn.Module:
    """BatchNorm2d without affine parameters, its running statistics a cumulative average (momentum=None)."""
    return sync_batchnorm(nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, affine=False, momentum=None), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3)))


def small_images() -> TensorDataset:
    gen = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(64, 1, 4, 4, generator=gen), torch.randint(3, (64,), generator=gen))


@pytest.mark.parametrize("make_model, make_data",
                         [(synced_batchnorm_mlp, vectors), (synced_batchnorm_conv, small_images)],
                         ids=["BatchNorm1d-affine", "BatchNorm2d-momentum-None"])
def test_sync_batchnorm_trains_as_one_process_at_worlds_2_and_3(make_model, make_data):
    """sync_batchnorm on CPU processes: every step's gradients, parameters and buffers (the running mean, the
    unbiased running variance, the batch count) at worlds 2 and 3 equal one process's on the global batch
    (float64, rtol 1e-9), where the same model unconverted fails naming BatchNorm (the test above)."""
    assert_ddp_equivalent(make_model, make_data, cross_entropy, world_sizes=(2, 3))


def test_dropout_is_named_with_its_probability_and_the_keyword():
    message = failure(dropout_mlp, vectors, cross_entropy, world_sizes=(2,))
    assert "Dropout in `1` (Dropout, p=0.5)" in message and "pass disable_dropout=True" in message


def test_random_augmentation_through_seeded_dataset_trains_the_same():
    """Each sample's augmentation depends on (seed, epoch, index) alone: the ranks and one process see the same
    data, so a correct model passes at worlds 2 and 3 although every read of the dataset draws randomness."""
    assert_ddp_equivalent(mlp, seeded_augmented, cross_entropy)


def test_random_augmentation_per_rank_fails_naming_seeded_dataset():
    """The same augmentation unseeded: each rank draws its own, the check fails, and the message names per-rank
    data randomness and the helper rather than blaming the (correct) model."""
    message = failure(mlp, augmented, cross_entropy, world_sizes=(2,))
    assert "the data's items change from one read to the next" in message, message
    assert "seeded_dataset(data, seed)" in message, message


def test_dropout_inside_a_transformer_block_is_named():
    message = failure(functools.partial(TransformerClassifier, 0.3), sequences, cross_entropy, world_sizes=(2,))
    assert "`block.dropout` (Dropout, p=0.3)" in message


@pytest.mark.parametrize("make_model, make_data", [
    (dropout_mlp, vectors), (functools.partial(TransformerClassifier, 0.3), sequences),
    (attention_dropout_only, sequences), (gpt_like, sequences)])
def test_disable_dropout_checks_a_model_with_dropout(make_model, make_data):
    """Every dropout probability 0 for the check, nn.MultiheadAttention's included (its own float)."""
    failure(make_model, make_data, cross_entropy, world_sizes=(2,))
    assert_ddp_equivalent(make_model, make_data, cross_entropy, world_sizes=(2,), disable_dropout=True)


@pytest.mark.parametrize("make_model, make_data, cause, modules", [
    (deep_batchnorm, vectors, "BatchNorm in `1` (BatchNorm1d), `3` (BatchNorm1d), `5` (BatchNorm1d) and 17 more",
     "BatchNorm"),
    (gpt_like, sequences, "Dropout in `1.layers.0.self_attn` (MultiheadAttention, p=0.1), `1.layers.0.dropout` "
                          "(Dropout, p=0.1), `1.layers.0.dropout1` (Dropout, p=0.1) and 5 more", "Dropout")])
def test_a_cause_in_many_modules_is_one_paragraph_that_fits_a_screen(make_model, make_data,
                                                                                    cause, modules):
    message = failure(make_model, make_data, cross_entropy, world_sizes=(2,))
    assert cause in message and message.count(f"{modules} in ") == 1, message
    assert len(message.splitlines()) <= 10 and max(map(len, message.splitlines())) <= 400, message


def test_buffers_are_compared_a_diverging_buffer_fails_while_parameters_agree():
    message = failure(tallies_its_inputs, vectors, cross_entropy, world_sizes=(2,))
    assert "world size 2, step 1, `seen` after the optimizer step" in message, message


def test_a_relative_divergence_of_1e5_is_caught_and_rounding_is_not():
    message = failure(mlp, vectors, functools.partial(scaled_under_ddp, 1 + 1e-5), world_sizes=(2,))
    assert "step 1, the gradient of `0.weight`" in message
    assert float(re.search(r"largest relative error (\S+)", message).group(1)) == pytest.approx(1e-5, rel=0.01)
    assert_ddp_equivalent(mlp, vectors, functools.partial(scaled_under_ddp, 1 + 1e-12), world_sizes=(2,))


def test_every_step_is_compared_a_divergence_at_the_last_step_fails():
    message = failure(diverges_at_the_third_step, vectors, cross_entropy, world_sizes=(2,), steps=3)
    assert "world size 2, step 3, `linear.weight` after the optimizer step" in message, message


@pytest.mark.parametrize("world", [2, 3])
def test_summed_loss_is_named_as_a_world_size_factor(world):
    message = failure(mlp, vectors, summed_cross_entropy, world_sizes=(world,))
    assert f"world size {world}, step 1, the gradient of `0.weight`" in message
    assert f"about 1/{world} (the world size)" in message and "batch mean" in message
    errors = re.search(r"largest absolute error (\S+), largest relative error (\S+)", message)
    assert float(errors.group(2)) == pytest.approx(1 - 1 / world, rel=1e-3)  # printed to 3 digits


def test_unused_parameters_name_the_keyword_and_tracebacks_come_once():
    message = failure(with_unused, vectors, cross_entropy, world_sizes=(2,))
    assert "world size 2" in message
    assert "pass find_unused_parameters=True to the check and to DDP in your script" in message  # not torch's
    assert message.count("Traceback") == 0 and message.count("rank 0's traceback, last lines:") == 1, message
    assert len(message.splitlines()) <= 15, message
    path = re.search(r"every failed run's whole traceback: (\S+)", message).group(1)
    full = Path(path).read_text()
    assert "--- rank 0:" in full and "--- rank 1:" in full and "--- one process:" in full, full
    assert full.count("Traceback") == 3, full


def test_ddp_options_reach_every_ranks_ddp():
    assert_ddp_equivalent(with_unused, vectors, cross_entropy, world_sizes=(2, 3), find_unused_parameters=True)
    # Options every torch since 2.8 has (forward_sync_buffers is 2.13's; the GPU machines here run 2.11).
    assert_ddp_equivalent(mlp, vectors, cross_entropy, world_sizes=(2,), gradient_as_bucket_view=True,
                          static_graph=True)


def test_an_unknown_ddp_option_is_rejected_naming_it():
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['find_unused_params'\].*find_unused_parameters"):
        assert_ddp_equivalent(with_unused, vectors, cross_entropy, find_unused_params=True)


def test_replicas_that_drift_apart_are_named():
    message = failure(counts_its_data, vectors, cross_entropy, world_sizes=(2,))
    assert "world size 2, step 1, `linear.bias` after the optimizer step (rank 1 differs from rank 0)" in message
    assert "replicas that differ from each other" in message


def test_the_first_diverging_tensor_is_named_in_parameter_order():
    """BatchNorm changes every gradient; the report names the first parameter, `0.weight`."""
    message = failure(batchnorm_mlp, vectors, cross_entropy, world_sizes=(3,), steps=1)
    assert re.search(r"world size 3, step 1, the gradient of `0\.weight`", message), message


@pytest.mark.slow
def test_a_hung_rank_fails_the_call_after_the_timeout_and_the_next_call_works(monkeypatch):
    monkeypatch.setattr(ddp_check, "TIMEOUT_S", 3.0)
    message = failure(slow_on_rank_one, vectors, cross_entropy, world_sizes=(2,))
    assert "world size 2" in message and "did not finish within 3 s on ranks [0, 1]" in message
    monkeypatch.undo()
    assert_ddp_equivalent(mlp, vectors, cross_entropy, world_sizes=(2,))  # a new pool: the hung one was stopped


def task_fails_on_rank_0_and_hangs_on_rank_1(spec: dict) -> None:
    if distributed.get_rank() == 0:
        raise ValueError("the root cause, on rank 0")
    os.dup2(os.open(spec["stderr"], os.O_WRONLY | os.O_CREAT), 2)  # this rank's stderr, where faulthandler writes
    time.sleep(30)  # as in a collective whose peer has gone


@pytest.mark.slow
def test_a_hang_carries_the_failed_ranks_error_and_the_hung_stacks(tmp_path):
    """Rank 0 raises, rank 1 waits on: the hang's PoolError carries rank 0's traceback (the root cause; a CI run
    once showed only "a hang on ranks [1]"), and rank 1 wrote its stack on its stderr before the pool gave up."""
    pool = ddp_check.WorkerPool(2)
    try:
        with pytest.raises(ddp_check.PoolError) as caught:
            pool.run(task_fails_on_rank_0_and_hangs_on_rank_1, {"stderr": str(tmp_path / "stderr1")}, timeout=4)
        message = str(caught.value)
        assert "did not finish within 4 s on ranks [1] (world 2): a hang" in message, message
        assert "--- rank 0, which replied:" in message and "ValueError: the root cause, on rank 0" in message
        assert list(caught.value.tracebacks) == [0] and caught.value.hung == [1]
        deadline, dumped = time.monotonic() + 20, ""
        while "in task_fails_on_rank_0_and_hangs_on_rank_1" not in dumped and time.monotonic() < deadline:
            time.sleep(0.1)
            dumped = (tmp_path / "stderr1").read_text()
        assert "in task_fails_on_rank_0_and_hangs_on_rank_1" in dumped, dumped
    finally:
        pool.close()


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



@pytest.mark.slow
def test_check_runs_from_a_plain_script_and_leaves_no_process(tmp_path):
    script = SCRIPTS / "check_mine.py"
    marker = f"DDP_CHECK_{tmp_path.name}"
    out = run([sys.executable, str(script)], env={marker: "1"}, timeout=180)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 3 and lines[0] == lines[2] == "equivalent", out.stdout
    assert lines[1].startswith("diverges: DDP diverges"), out.stdout
    assert leftover_processes(marker) == []


# ------------------------------ assert_step_equivalent: a user's whole step ---------------------
# Each step below is written as users write it; the buggy ones are the bugs that shipped (issue 45).


def _micro_loss(model: nn.Module, batch, micro_batches: list) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y) / len(micro_batches)


def step_nanogpt(model, optimizer, scaler, micro_batches, step):
    """nanoGPT's shape: the sync flag set before each forward, a scaled loss, unscale, clip, step, zero_grad."""
    for i, batch in enumerate(micro_batches):
        model.require_backward_grad_sync = i == len(micro_batches) - 1
        scaler.scale(_micro_loss(model, batch, micro_batches)).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def step_no_sync(model, optimizer, scaler, micro_batches, step):
    """The tutorial's shape: every micro-step but the last, forward and backward, inside no_sync()."""
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            _micro_loss(model, batch, micro_batches).backward()
    optimizer.step()
    optimizer.zero_grad()


def step_flag_after_forward(model, optimizer, scaler, micro_batches, step):
    for i, batch in enumerate(micro_batches):
        loss = _micro_loss(model, batch, micro_batches)
        model.require_backward_grad_sync = i == len(micro_batches) - 1  # after the forward: too late
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def step_no_sync_around_backward_only(model, optimizer, scaler, micro_batches, step):
    for i, batch in enumerate(micro_batches):
        loss = _micro_loss(model, batch, micro_batches)
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def step_loss_not_divided(model, optimizer, scaler, micro_batches, step):
    for i, (x, y) in enumerate(micro_batches):
        model.require_backward_grad_sync = i == len(micro_batches) - 1
        scaler.scale(F.cross_entropy(model(x), y)).backward()  # not / len(micro_batches)
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # hides the factor from the optimizer's gradients
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def step_clips_scaled_gradients(model, optimizer, scaler, micro_batches, step):
    """pytorch/examples#1196: clipping before unscale_ clips the scaled gradients."""
    for i, batch in enumerate(micro_batches):
        model.require_backward_grad_sync = i == len(micro_batches) - 1
        scaler.scale(_micro_loss(model, batch, micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def test_correct_steps_pass_the_whole_step_check():
    """nanoGPT's step (sync flag before the forward, GradScaler, unscale_, clipping) at worlds 2 and 3 on a tiny
    transformer, and the no_sync() shape on an MLP, train as one process does."""
    assert_step_equivalent(transformer, sequences, step_nanogpt)
    assert_step_equivalent(mlp, vectors, step_no_sync, world_sizes=(2,), accum=3)


@pytest.mark.parametrize("train_step, message", [
    (step_flag_after_forward, r"all-reduced at micro-step\(s\) \[1\] of 2, not at the last\n.*the sync flag decided "
                              r"after the forward .*DDP decides at the forward"),
    (step_no_sync_around_backward_only, r"every micro-step of step 1 all-reduced \(\[1, 2\]\).*costs 2x the traffic"
                                        r"\n.*no_sync\(\) around the backward only"),
    (step_loss_not_divided, r"the gradients are about 2x \(the micro-batches\) one batch's: divide each micro-batch's "
                            r"loss by their number \(2\)"),
    (step_clips_scaled_gradients, r"differently at loss scale 1024 than at 1(.|\n)*gradients used before "
                                  r"scaler.unscale_\(optimizer\): clipping"),
], ids=["sync-flag-after-forward", "no_sync-around-backward-only", "loss-not-divided", "clipping-scaled-grads"])
def test_a_buggy_step_fails_naming_its_cause(train_step, message):
    with pytest.raises(AssertionError, match=message):
        assert_step_equivalent(mlp, vectors, train_step, world_sizes=(2,))


def step_moves_batches_to_cuda(model, optimizer, scaler, micro_batches, step):
    """A step copied from a GPU loop as is: it moves each batch to the GPU itself."""
    for x, y in micro_batches:
        torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward()
    optimizer.step()


def test_a_step_that_moves_to_cuda_gets_the_devices_hint():
    """The check runs its ranks on CPU: a step with x.cuda() fails with torch's "No CUDA GPUs are available" (GPUs
    hidden), "not compiled with CUDA" (a CPU build) or "Found no NVIDIA driver" (pip's default CUDA build on a
    host without a driver) from every rank, and the check says to leave devices and autocast to it."""
    with pytest.raises(AssertionError, match=r"(No CUDA GPUs are available|not compiled with CUDA|Found no NVIDIA "
                                             r"driver)(.|\n)*The check's ranks are CPU processes: leave devices and "
                                             r"autocast to it"):
        assert_step_equivalent(mlp, vectors, step_moves_batches_to_cuda, world_sizes=(2,))


def step_on_a_host_without_an_nvidia_driver(model, optimizer, scaler, micro_batches, step):
    """What x.cuda() raises where pip's default torch (a CUDA build) runs on a host with no NVIDIA driver: a CPU
    build, as this suite's, cannot raise it."""
    raise RuntimeError("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and "
                       "installed a driver from http://www.nvidia.com/Download/index.aspx")


def test_a_cuda_build_without_a_driver_also_gets_the_devices_hint():
    """The same step run where torch is a CUDA build but the host has no driver (a CPU machine, a login node)
    fails with another message; the check still says why (found on Python 3.13 with pip's default torch)."""
    with pytest.raises(AssertionError, match=r"Found no NVIDIA driver(.|\n)*The check's ranks are CPU processes"):
        assert_step_equivalent(mlp, vectors, step_on_a_host_without_an_nvidia_driver, world_sizes=(1,))


def test_no_sync_around_the_backward_passes_when_its_traffic_is_accepted():
    assert_step_equivalent(mlp, vectors, step_no_sync_around_backward_only, world_sizes=(2,),
                           accept_sync_every_micro_step=True)


def test_an_unused_parameter_is_named_with_its_step_rank_and_the_safe_option():
    """The parameter that got no gradient by its qualified name, where, and which DDP option fits (accumulation
    rules out static_graph, pytorch/pytorch#143580), although DDP's own error comes a step later, in indices."""
    with pytest.raises(AssertionError, match=r"step 2 raised on rank 0\n.*`unused.bias`, `unused.weight` got no "
                                             r"gradient at step 1 on rank 0 \(DDP waits for every parameter\): pass "
                                             r"find_unused_parameters=True to the check and to DDP in your script "
                                             r"\(not static_graph=True: with no_sync accumulation it fails"):
        assert_step_equivalent(with_unused, vectors, step_nanogpt, world_sizes=(2,))


def step_summed_loss(model, optimizer, scaler, micro_batches, step):
    """The no_sync() shape with each micro-batch's loss summed over its samples, not averaged."""
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.nullcontext() if i == len(micro_batches) - 1 else model.no_sync():
            (F.cross_entropy(model(x), y, reduction="sum") / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("accum", [1, 3])
def test_a_summed_loss_is_named_alike_by_the_model_and_the_step_check(accum):
    """One engine, one list of causes: a loss summed over the samples is named by both checks, as the world-size
    factor (1 micro-batch) or as the micro-batches' factor, which the check compares first (3)."""
    model_check = failure(mlp, vectors, summed_cross_entropy, world_sizes=(2,), accum=accum, batch_size=2)
    with pytest.raises(AssertionError) as info:
        assert_step_equivalent(mlp, vectors, step_summed_loss, world_sizes=(2,), accum=accum)
    factor = "1/2 (the world size) of one process's" if accum == 1 else "1/3 (the micro-batches) of one batch's"
    for message in (model_check, str(info.value)):
        assert "step 1, the gradient of `0.weight`" in message, message
        assert f"about {factor}: " in message and "must be the batch mean. A summed loss" in message, message


def test_per_rank_data_randomness_is_named_in_a_step_check():
    with pytest.raises(AssertionError, match=r"the data's items change from one read to the next"):
        assert_step_equivalent(mlp, augmented, step_nanogpt, world_sizes=(2,))


def test_mixed_precision_smoke_passes_a_right_step_and_fails_an_undivided_loss():
    """bf16 autocast, the model in float32: first-step gradients within 10% by norm. A right step passes; one
    that forgets to divide the loss by the micro-batches is 100% off."""
    assert_step_equivalent(mlp, vectors, step_nanogpt, world_sizes=(2,), mixed_precision=True)
    with pytest.raises(AssertionError, match=r"about 2x \(the micro-batches\)"):
        assert_step_equivalent(mlp, vectors, step_loss_not_divided, world_sizes=(2,), mixed_precision=True)


def test_an_accumulation_formula_on_one_nodes_gpus_is_named():
    """karpathy/nanoGPT#283: the accumulation count from the GPUs of one node changes the global batch with the
    world size (here one process per node); one from the world size keeps it."""
    assert_step_equivalent(mlp, vectors, step_nanogpt, world_sizes=(2,),
                           accum=lambda: 8 // (2 * int(os.environ["WORLD_SIZE"])), batch_size=2)
    with pytest.raises(AssertionError, match=r"changes the global batch .* \{2: 32, 3: 48\}.*LOCAL_WORLD_SIZE"):
        assert_step_equivalent(mlp, vectors, step_nanogpt, accum=lambda: 8 // int(os.environ["LOCAL_WORLD_SIZE"]))
    with pytest.raises(AssertionError, match=r"divided by zero at world size 2 .*torch.cuda.device_count\(\)"):
        assert_step_equivalent(mlp, vectors, step_nanogpt, accum=lambda: 8 // torch.cuda.device_count())


@pytest.mark.parametrize("where", ["before_ddp", "after_ddp"])
def test_a_step_on_a_compiled_model_passes_where_the_script_compiles(where):
    """torch.compile (backend "eager": no compiler needed) before DDP, as nanoGPT does, or around it."""
    assert_step_equivalent(mlp, vectors, step_nanogpt, world_sizes=(2,), compile_model=where)

"""Check your own model and training step: does DDP train as one process does? Copy next to distributed.py.

    # test_my_model.py                          (top-level callables: ranks are separate processes)
    from ddp_check import assert_ddp_equivalent, assert_step_equivalent
    from my_project import make_model, make_data, loss_fn, train_step

    def test_my_model_trains_the_same_under_ddp():
        assert_ddp_equivalent(make_model, make_data, loss_fn)

    def test_my_step_trains_the_same_under_ddp():    # accumulation, loss scaling, clipping: your whole step
        assert_step_equivalent(make_model, make_data, train_step)

One engine behind both: assert_ddp_equivalent is the step check with a standard step (each micro-batch's mean
loss over their number, all but the last under no_sync(), then the optimizer). For each world size W it trains,
in float64 on real gloo processes of this machine:

    ddp      W ranks through DDP, each drawing its batches through distributed.data_sampler;
    micro    one process with the same micro-batch structure (micro-batch m: the union of the ranks' m-th);
    scaled   the same at loss scale 1024 (your step only: a GradScaler it must use; a power of two is exact);
    whole    one process on each step's samples in one batch (when there are 2 or more micro-batches).

A hook on DDP's all-reduce records at which micro-step each step synchronised and the gradients it averaged
(before any clipping); every step's parameters and buffers are kept. The first of these that fails names it and
its likely cause, in this order (_CAUSES walks it), the same for both checks:

    1. the data's items change between two reads (before any process trains): seeded_dataset is the fix;
    2. a step raised (unused parameters named with the step, rank and the DDP option that fits);
    3. DDP all-reduced at another micro-step than the last;
    4. one process trains differently at loss scale 1024 than at 1 (gradients used before unscale_);
    5. micro against whole: accumulation (a loss not divided by the micro-batches), or the model's suspects;
    6. the replicas differ from each other (state changed from a rank's own data);
    7. ddp against micro: a factor of the world size (a summed loss), or the model's suspects (BatchNorm,
       dropout).

Compared: the first step's averaged gradients, then every parameter and buffer after every step, in the
model's order. Replicas must be bitwise equal. Tolerance: rtol = 1e-7, and atol = 1e-7 x the reference
tensor's largest magnitude (at least 1). In float64 the only honest difference is the order of the
all-reduce's sums (~1e-16 relative). Adaptive optimizers (Adam) divide by sqrt(v) + eps, which amplifies the
rounding of a near-zero gradient up to lr / eps times; with float64 and eps >= 1e-8 that stays below 1e-10
over a few steps (measured in this project's suite), so 1e-7 keeps three orders of magnitude of margin on both
sides: every cause named above diverges by 1e-3 or more. mixed_precision=True (step check): the model in
float32 under CPU bf16 autocast, only the first step's gradients, each within 10% by norm (bf16 keeps 3
significant digits: 1% per tensor is ordinary between 1 and N processes; every bug named here is 25% or more).

Worker pools are started once per world size and reused by every call in this Python process (the first call
takes a few seconds), stopped at exit; a rank that hangs fails the call after TIMEOUT_S seconds, its Python
stacks printed on its stderr just before, and the error carries the traceback of any rank that failed first.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import faulthandler
import functools
import inspect
import multiprocessing.connection
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler
from torch.utils.data.dataloader import default_collate

import distributed

__all__ = ["assert_ddp_equivalent", "assert_step_equivalent", "worker_pools", "WorkerPools", "PoolError",
           "TIMEOUT_S"]

TIMEOUT_S = 60.0            # a call that takes longer on some rank is a hang: its pool is restarted
_GROUP_TIMEOUT_S = 30.0     # a collective stuck this long fails inside the ranks too
_RTOL = 1e-7
_MIXED_RTOL = 0.1           # mixed_precision: each first-step gradient's error norm within 10% of its norm
_SCALE = 2.0 ** 10          # the second loss scale: a power of two, exact in float64
_TRACEBACK_LINES = 8        # of the first failed rank's, in a report; the whole text goes to a file


def assert_ddp_equivalent(make_model: Callable[[], nn.Module], make_data: Callable[[], Any],
                          loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
                          make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
                          world_sizes: tuple[int, ...] = (2, 3), steps: int = 3, batch_size: int = 4,
                          accum: int | Callable[[], int] = 1, seed: int = 0, disable_dropout: bool = False,
                          after_ddp: Callable[[DDP], Any] | None = None, rtol: float = _RTOL,
                          **ddp_options: Any) -> None:
    """Raise AssertionError, naming the likely cause, if DDP training of ``make_model()`` differs from 1 process.

    make_model(): an nn.Module, built after torch.manual_seed(seed) in every run. make_data(): a map-style
    Dataset whose items (tensors, or tuples, lists or dicts of them) the default collate can batch.
    loss_fn(model, batch): the batch's mean loss (floating-point tensors in float64), as your training code
    computes it. make_optimizer(params): an optimizer (default: SGD, lr 0.1). All must be top-level functions of
    an importable module (functools.partial of one works too). accum: micro-batches per step (the standard step
    divides each loss by their number; a function as assert_step_equivalent takes). disable_dropout=True: every
    dropout probability set to 0 for the check (nn.Dropout and its variants, nn.MultiheadAttention's), since
    random masks cannot match one process's; dropout itself is then unchecked, and so is a probability kept as
    a plain number and passed to a function (F.dropout, scaled_dot_product_attention's dropout_p). after_ddp(ddp):
    run on every rank right after DDP(...), as your script does (a comm hook: shared_memory_allreduce, or one of
    torch's; the check records through it); with a lossy hook, raise ``rtol``. ddp_options: passed to every
    rank's DDP(...), as in your training code (find_unused_parameters=True, gradient_as_bucket_view=True,
    static_graph=True, ...; static_graph fails with no_sync accumulation: pytorch/pytorch#143580).
    """
    _check_importable("loss_fn", loss_fn)
    spec = _Spec(make_model, make_data, functools.partial(_standard_step, loss_fn), make_optimizer or _sgd,
                 steps, batch_size, seed, disable_dropout, tuple(sorted(ddp_options.items())), after_ddp, rtol,
                 own_step=False)
    _check("assert_ddp_equivalent", spec, world_sizes, accum)


def assert_step_equivalent(make_model: Callable[[], nn.Module], make_data: Callable[[], Any],
                           train_step: Callable[..., Any], *,
                           make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
                           world_sizes: tuple[int, ...] = (2, 3), accum: int | Callable[[], int] = 2,
                           batch_size: int = 2, steps: int = 3, seed: int = 0, disable_dropout: bool = False,
                           after_ddp: Callable[[DDP], Any] | None = None, rtol: float = _RTOL,
                           mixed_precision: bool = False, compile_model: str | None = None,
                           accept_sync_every_micro_step: bool = False, **ddp_options: Any) -> None:
    """Raise AssertionError, naming the likely cause, when ``train_step`` trains differently under DDP than in one
    process: the DDP bugs that live in a loop's step (accumulation, loss scaling, clipping), not in the model.

    train_step(model, optimizer, scaler, micro_batches, step): one optimizer step copied from your loop. ``model``
    is the DDP-wrapped model, ``micro_batches`` a list of ``accum`` batches of ``batch_size`` samples for this
    rank (collated as assert_ddp_equivalent does), ``scaler`` a torch.amp.GradScaler the step must use if it
    scales the loss (the check chooses its scale), ``step`` the step index (for your LR schedule). Leave devices
    and autocast to the check: its ranks are CPU processes. The other arguments are assert_ddp_equivalent's.
    accum: an int, or a zero-argument function computing it as your script does: it is evaluated for each world
    size with WORLD_SIZE set and one process per node (LOCAL_WORLD_SIZE=1, no GPU), and must keep the global
    batch (batch_size x accum x W) the same. mixed_precision=True: a smoke test of the model in float32 under
    torch.autocast("cpu", dtype=torch.bfloat16) (the module docstring says what it compares). compile_model:
    "before_ddp" or "after_ddp": torch.compile (backend "eager") where your script calls it.
    accept_sync_every_micro_step=True: a step whose every micro-step all-reduces (right values, accum x the
    traffic) passes.
    """
    if compile_model not in (None, "before_ddp", "after_ddp"):
        raise ValueError(f"compile_model must be None, 'before_ddp' or 'after_ddp', got: {compile_model!r}")
    spec = _Spec(make_model, make_data, train_step, make_optimizer or _sgd, steps, batch_size, seed,
                 disable_dropout, tuple(sorted(ddp_options.items())), after_ddp, rtol, own_step=True,
                 mixed_precision=mixed_precision, compile_model=compile_model,
                 accept_sync_every_micro_step=accept_sync_every_micro_step)
    _check("assert_step_equivalent", spec, world_sizes, accum)


# ------------------------------ The engine: one spec, four runs per world size, one diagnosis --------


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What every run of one check trains; sent to the ranks as it is (every callable a top-level one)."""
    make_model: Callable[[], nn.Module]
    make_data: Callable[[], Any]
    train_step: Callable[..., Any]
    make_optimizer: Callable[[Any], torch.optim.Optimizer]
    steps: int
    batch_size: int
    seed: int
    disable_dropout: bool
    ddp_options: tuple[tuple[str, Any], ...]
    after_ddp: Callable[[DDP], Any] | None
    rtol: float
    own_step: bool                      # the user's train_step: also run at a second loss scale
    mixed_precision: bool = False
    compile_model: str | None = None
    accept_sync_every_micro_step: bool = False


@dataclasses.dataclass(frozen=True)
class _Run:
    """One of a world size's runs: ``ranks`` processes (the world size for ddp, else 1)."""
    spec: _Spec
    world: int
    ranks: int
    accum: int
    scale: float = 1.0
    whole: bool = False                 # each step's samples in one batch


def _check(front: str, spec: _Spec, world_sizes: tuple[int, ...], accum: int | Callable[[], int]) -> None:
    accums = _accums(accum, world_sizes, spec.batch_size)
    model, data = _check_inputs(front, spec, world_sizes, accums)
    try:
        distributed.check_repeatable(data)  # cause 1: no run could agree
    except ValueError as e:
        raise AssertionError(f"DDP cannot train as 1 process does: {e}") from None
    suspects = _suspects(model)
    for world in world_sizes:
        count = accums[world]
        plan = {"ddp": _Run(spec, world, world, count)}
        if world > 1:  # at world 1 the DDP run is the one process with the same micro-batches
            plan["micro"] = _Run(spec, world, 1, count)
        if spec.own_step and not spec.mixed_precision:
            plan["scaled"] = _Run(spec, world, 1, count, scale=_SCALE)
        if count > 1:
            plan["whole"] = _Run(spec, world, 1, count, whole=True)
        runs = {}
        for name, run in plan.items():
            try:
                runs[name] = worker_pools().run(run.ranks, _train, run)
            except PoolError as e:
                raise AssertionError(_pool_failure(_head(world, count), e, suspects)) from None
        runs.setdefault("micro", runs["ddp"])
        problem = _diagnose(_Outcome(spec, world, count, runs, suspects))
        if problem:
            raise AssertionError(problem)


def _standard_step(loss_fn: Callable, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any,
                   micro_batches: list, step: int) -> None:
    """assert_ddp_equivalent's step: every micro-batch's loss over their number, forward and backward of all but
    the last under no_sync() (no all-reduce), then the optimizer."""
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            (loss_fn(model, batch) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


# ------------------------------ On the ranks: one function for every run -----------------------------


def _train(run: _Run) -> dict:
    """The step through DDP on this run's micro-batches, recording which micro-steps all-reduced, the averaged
    gradients, the parameters and buffers after each step, and the parameters that got no gradient. An
    exception in the step is recorded with the step it ended."""
    spec = run.spec
    model = _model(spec)
    if spec.mixed_precision:
        model = model.float()
    inner = model
    if spec.compile_model == "before_ddp":
        inner = torch.compile(model, backend="eager")
    ddp = DDP(inner, **dict(spec.ddp_options))
    names = {p: name for name, p in model.named_parameters()}
    now: dict[str, Any] = {"forwards": 0}
    _record_allreduces(ddp, spec.after_ddp, names, now)
    wrapped = ddp
    if spec.compile_model == "after_ddp":
        wrapped = torch.compile(ddp, backend="eager")
    model.register_forward_pre_hook(lambda *_: now.update(forwards=now["forwards"] + 1))
    for p in names:
        p.register_post_accumulate_grad_hook(lambda p: now["got"].add(names[p]))
    data = spec.make_data()
    optimizer = spec.make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=run.scale, growth_interval=2 ** 30)
    autocast = contextlib.nullcontext()
    if spec.mixed_precision:
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    record: dict[str, Any] = {"syncs": [], "grads": [], "states": [], "unused": [], "error": None}
    for step, micro in enumerate(_micro_batches(run, data)):
        batches = [default_collate([data[i] for i in indices]) for indices in micro]
        if not spec.mixed_precision:
            batches = [_float64(batch) for batch in batches]
        now.update(forwards=0, grads={}, got=set(), syncs=set(), scale=scaler.get_scale())
        try:
            with autocast:
                spec.train_step(wrapped, optimizer, scaler, batches, step)
        except Exception:
            record["error"] = traceback.format_exc()
            break
        record["syncs"].append(sorted(now["syncs"]))
        record["grads"].append(now["grads"])
        record["states"].append(_state(model))
        record["unused"].append(sorted(set(names.values()) - now["got"]))
    return record


def _record_allreduces(ddp: DDP, after_ddp: Callable | None, names: dict, now: dict) -> None:
    """DDP takes one comm hook: the one after_ddp registers (or DDP's default all-reduce) runs inside a recording
    one, which notes the micro-step and keeps the averaged gradients, divided by the loss scale."""
    registered = []
    if after_ddp is not None:
        ddp.register_comm_hook = lambda state, hook: registered.append((state, hook))  # shadows the method
        try:
            after_ddp(ddp)
        finally:
            del ddp.register_comm_hook
    state, hook = registered[0] if registered else (None, default_hooks.allreduce_hook)

    def recording(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
        now["syncs"].add(now["forwards"])

        def keep(future: Any) -> torch.Tensor:
            flat, start = future.value(), 0
            for p in bucket.parameters():
                now["grads"][names[p]] = flat[start:start + p.numel()].view_as(p).clone() / now["scale"]
                start += p.numel()
            return flat
        return hook(state, bucket).then(keep)
    ddp.register_comm_hook(state, recording)


def _micro_batches(run: _Run, data: Any) -> list[list[list[int]]]:
    """Per step, the micro-batches' sample indices. The DDP ranks draw through distributed.data_sampler; one
    process takes each rank's shard from torch's DistributedSampler, micro-batch m the union of the ranks' m-th
    (``whole``: a step's samples in one batch)."""
    spec, size, accum = run.spec, run.spec.batch_size, run.accum
    if run.ranks > 1 or run.world == 1:
        sampler = distributed.data_sampler(data, shuffle=True, seed=spec.seed)
        sampler.set_epoch(0)  # and the epoch of a dataset that has one (seeded_dataset's), 0 until set
        shards = [list(sampler)]
    else:
        shards = [_shard(data, run.world, rank, spec.seed) for rank in range(run.world)]
    steps = []
    for step in range(spec.steps):
        micro = [[i for shard in shards for i in shard[(step * accum + m) * size:(step * accum + m + 1) * size]]
                 for m in range(accum)]
        steps.append([sum(micro, [])] if run.whole else micro)
    return steps


def _shard(data: Any, world: int, rank: int, seed: int) -> list[int]:
    """Rank ``rank``'s indices in order, as torch's DistributedSampler gives them (no group needed)."""
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=seed)
    sampler.set_epoch(0)
    return list(sampler)


def _model(spec: _Spec) -> nn.Module:
    torch.manual_seed(spec.seed)
    model = spec.make_model().double()
    if spec.disable_dropout:
        return _without_dropout(model)
    return model


def _without_dropout(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        elif isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
    return model


def _float64(batch: Any) -> Any:
    """The batch with its floating-point tensors in float64 (tuples, lists and dicts recursively)."""
    if isinstance(batch, torch.Tensor):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _float64(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_float64(v) for v in batch)
    return batch


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: t.detach().clone() for name, t in named}


# ------------------------------ The diagnosis: one ordered list of causes ----------------------------
@dataclasses.dataclass(frozen=True)
class _Outcome:
    """One world size's runs, as the causes below read them."""
    spec: _Spec
    world: int
    accum: int
    runs: dict  # run name -> every rank's record
    suspects: list[str]  # the model's likely causes (BatchNorm, dropout), named with a difference

    @property
    def head(self) -> str:
        return _head(self.world, self.accum)

    @property
    def ddp(self) -> list[dict]:
        return self.runs["ddp"]

    @property
    def micro(self) -> dict:
        return self.runs["micro"][0]


def _diagnose(outcome: _Outcome) -> str | None:
    """The first cause that the runs show, walked in _CAUSES' order; None when they agree."""
    return next((found for cause in _CAUSES if (found := cause(outcome)) is not None), None)


def _a_step_raised(outcome: _Outcome) -> str | None:
    labelled = [(f"rank {rank}", record) for rank, record in enumerate(outcome.ddp)]
    if outcome.micro is not outcome.ddp[0]:  # at world 1 the same run
        labelled.append(("one process", outcome.micro))
    failed = {where: record for where, record in labelled if record["error"]}
    if failed:
        return _step_failure(outcome.head, outcome.accum, failed, outcome.suspects)
    return None


def _synced_at_another_micro_step(outcome: _Outcome) -> str | None:
    accum, every = outcome.accum, list(range(1, outcome.accum + 1))
    for step, syncs in enumerate(outcome.ddp[0]["syncs"], 1):
        if syncs == every and accum > 1 and not outcome.spec.accept_sync_every_micro_step:
            return (f"{outcome.head}: every micro-step of step {step} all-reduced ({syncs}), not only the last: "
                    f"the values are right but it costs {accum}x the traffic\n" + _cause(
                        "no_sync() around the backward only: DDP decides at the forward whether a backward "
                        "all-reduces, so put the forward inside no_sync() too (or pass "
                        "accept_sync_every_micro_step=True)"))
        if syncs != [accum] and syncs != every:
            return (f"{outcome.head}: at step {step} DDP all-reduced at micro-step(s) {syncs or 'none'} of {accum}, "
                    "not at the last\n" + _cause(
                        "the sync flag decided after the forward (require_backward_grad_sync set between forward "
                        "and backward): DDP decides at the forward, so set it before the forward of each "
                        "micro-step (True on the last), or run the other micro-steps' forward and backward "
                        "inside no_sync()"))
    return None


def _gradients_used_scaled(outcome: _Outcome) -> str | None:
    if "scaled" not in outcome.runs:
        return None
    scaled = outcome.runs["scaled"][0]
    for step, (a, b) in enumerate(zip(outcome.micro["states"], scaled["states"], strict=True), 1):
        name = next((n for n in a if not torch.equal(a[n], b[n])), None)
        if name is not None:
            return _divergence(f"{outcome.head}, step {step}, `{name}` after the optimizer step", b[name], a[name],
                               f"one process trains differently at loss scale {_SCALE:g} than at 1; in float64 a "
                               "power-of-two scale is exact", [
                                   "gradients used before scaler.unscale_(optimizer): clipping (clip_grad_norm_), "
                                   "a norm or a check on scaled gradients; call scaler.unscale_(optimizer) before "
                                   "clipping"])
    return None


def _accumulation_differs(outcome: _Outcome) -> str | None:
    if "whole" not in outcome.runs:
        return None
    micro, whole, accum = outcome.micro, outcome.runs["whole"][0], outcome.accum
    for step, what, (got, expected) in _tensors(outcome.spec, [micro, whole]):
        if not _close(got, expected, outcome.spec):
            causes = []
            factor = _factor(micro["grads"][0], whole["grads"][0])
            if factor is not None and abs(factor / accum - 1) < 0.05:
                causes.append(f"the gradients are about {accum}x (the micro-batches) one batch's: divide each "
                              f"micro-batch's loss by their number ({accum}) before backward")
            if factor is not None and abs(factor * accum - 1) < 0.05:
                causes.append(f"the gradients are about 1/{accum} (the micro-batches) of one batch's: the loss "
                              "must be the batch mean. A summed loss grows with the batch, so each of "
                              f"{accum} micro-batches of a sum, divided by {accum}, gives 1/{accum}")
            return _divergence(f"{outcome.head}, step {step}, {what}", expected, got, f"one process with {accum} "
                               "micro-batches differs from one batch of them all", causes + outcome.suspects)
    return None


def _replicas_or_world_size_differ(outcome: _Outcome) -> str | None:
    """Tensor by tensor: the replicas against rank 0 (state changed from a rank's own data), then rank 0 against one
    process (a factor of the world size, or the model's suspects)."""
    world, suspects = outcome.world, outcome.suspects
    for step, what, (first, *others, expected) in _tensors(outcome.spec, [*outcome.ddp, outcome.micro]):
        for rank, other in enumerate(others, 1):
            if not _equal(other, first):
                return _divergence(f"{outcome.head}, step {step}, {what}", first, other,
                                   f"rank {rank} differs from rank 0", [
                                       *suspects, "replicas that differ from each other: DDP keeps parameters equal "
                                       "by averaging gradients and broadcasts rank 0's buffers only at the start of "
                                       "each forward, so a buffer or parameter changed from a rank's own data (or "
                                       "rank-dependent code) drifts apart"])
        if not _close(first, expected, outcome.spec):
            causes = []
            factor = _factor(outcome.ddp[0]["grads"][0], outcome.micro["grads"][0])
            if world > 1 and factor is not None and abs(factor * world - 1) < 0.05:
                causes.append(f"the gradients are about 1/{world} (the world size) of one process's: DDP averages "
                              "gradients over ranks, so the loss must be the batch mean. A summed loss, or a sum "
                              "divided by a per-rank count, gives 1/world")
            if world > 1 and factor is not None and abs(factor / world - 1) < 0.05:
                causes.append(f"the gradients are about {world}x (the world size) one process's: DDP already "
                              "averages over ranks; do not multiply the loss by the world size")
            return _divergence(f"{outcome.head}, step {step}, {what}", expected, first,
                               "rank 0 differs from one process", causes + suspects)
    return None


# The module docstring's list from 2 on (1, data that changes between reads, is checked before any run trains).
_CAUSES = (_a_step_raised, _synced_at_another_micro_step, _gradients_used_scaled, _accumulation_differs,
           _replicas_or_world_size_differ)


def _head(world: int, accum: int) -> str:
    if accum > 1:
        return f"DDP diverges from 1-process training: world size {world}, accum {accum}"
    return f"DDP diverges from 1-process training: world size {world}"


def _tensors(spec: _Spec, records: list[dict]) -> list[tuple[int, str, list]]:
    """What is compared, in order, with each record's value: (step, what, values). The first step's averaged
    gradients, then every step's parameters and buffers, in the model's order (mixed precision: the gradients
    only). A gradient that a run never all-reduced is None."""
    order = list(records[-1]["states"][0])
    grads = [name for name in order if any(name in r["grads"][0] for r in records)]
    found = [(1, f"the gradient of `{name}`", [r["grads"][0].get(name) for r in records]) for name in grads]
    if spec.mixed_precision:
        return found
    for step in range(len(records[-1]["states"])):
        found += [(step + 1, f"`{name}` after the optimizer step", [r["states"][step][name] for r in records])
                  for name in order]
    return found


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(torch.equal(a, b))


def _close(a: torch.Tensor | None, b: torch.Tensor | None, spec: _Spec) -> bool:
    if a is None or b is None:
        return a is b
    if spec.mixed_precision:
        return bool((a.float() - b.float()).norm() <= _MIXED_RTOL * b.float().norm() + 1e-12)
    return bool(torch.allclose(a, b, rtol=spec.rtol, atol=spec.rtol * max(1.0, b.abs().max())))


def _factor(got: dict, expected: dict) -> float | None:
    """The factor c that best fits got = c x expected over every gradient (None when they are zero)."""
    names = [n for n in expected if n in got]
    if not names:
        return None
    a = torch.cat([got[n].flatten().double() for n in names])
    b = torch.cat([expected[n].flatten().double() for n in names])
    norm = (b * b).sum().item()
    return (a * b).sum().item() / norm if norm > 0 else None


def _divergence(where: str, expected: torch.Tensor | None, got: torch.Tensor | None, how: str,
                causes: list[str]) -> str:
    lines = [f"{where} ({how})"]
    if expected is None or got is None:
        lines.append("  only one side has this gradient: a parameter that one of them never used")
    else:
        error = (got.double() - expected.double()).abs()
        relative = torch.where(expected != 0, error / expected.double().abs(), 0.0)  # where one process has 0: none
        lines.append(f"  largest absolute error {error.max().item():.3g}, largest relative error "
                     f"{relative.max().item():.3g}")
    return "\n".join(lines + [_cause(c) for c in causes])


def _cause(text: str) -> str:
    return f"  likely cause: {text}"


def _suspects(model: nn.Module) -> list[str]:
    """What in the model is known to make DDP differ from one process: one cause each, naming modules."""
    batchnorms, dropouts = [], []
    for name, module in model.named_modules():
        where = f"`{name or '(the model)'}` ({type(module).__name__}"
        synced = isinstance(module, nn.SyncBatchNorm) or getattr(module, "synchronized", False)
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not synced:
            batchnorms.append(where + ")")
        p = 0.0
        if isinstance(module, nn.modules.dropout._DropoutNd):
            p = module.p
        elif isinstance(module, nn.MultiheadAttention):
            p = module.dropout
        if p > 0:
            dropouts.append(f"{where}, p={p})")
    found = []
    if batchnorms:
        found.append(f"BatchNorm in {_first_few(batchnorms)} normalizes each rank's batch with that rank's "
                     "own statistics: convert the model with sync_batchnorm(model) (`from sync_batchnorm import "
                     "sync_batchnorm`, the file beside distributed.py) before DDP (torch's "
                     "SyncBatchNorm on GPUs, an exact version on CPU processes), or use GroupNorm/LayerNorm")
    if dropouts:
        found.append(f"Dropout in {_first_few(dropouts)}: random masks cannot match one process's; pass "
                     "disable_dropout=True to check the rest of the model (dropout itself is then unchecked)")
    return found


def _first_few(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _step_failure(head: str, accum: int, failed: dict[str, dict], suspects: list[str]) -> str:
    """Cause 2: where the step raised first, the parameters that got no gradient in the step before (DDP's
    own error comes a step later, in indices), then that run's traceback, trimmed; every run's in a file."""
    where, record = next(iter(failed.items()))
    step = len(record["syncs"]) + 1  # the step that raised, from 1
    causes = []
    unused = record["unused"][-1] if record["unused"] else []
    if unused:
        if accum > 1:
            fits = "not static_graph=True: with no_sync accumulation it fails, pytorch/pytorch#143580"
        elif all(u == unused for u in record["unused"]):
            fits = "static_graph=True fits too: the same set is unused at every step"
        else:
            fits = "not static_graph=True: the set unused changes from step to step"
        causes.append(f"{_first_few([f'`{n}`' for n in unused])} got no gradient at step {step - 1} on {where} "
                      f"(DDP waits for every parameter): pass find_unused_parameters=True to the check and to DDP "
                      f"in your script ({fits}), or make them take part")
    return _failure(f"{head}: step {step} raised on {where}", {w: r["error"] for w, r in failed.items()},
                    causes + suspects)


def _pool_failure(head: str, error: PoolError, suspects: list[str]) -> str:
    """A run that failed outside the step (building the model, DDP, the data) or hung."""
    if not error.tracebacks:  # a hang: the message names the ranks and the timeout
        return f"{head}: {error}"
    failed = {f"rank {rank}": text for rank, text in sorted(error.tracebacks.items())}
    hung = f", and ranks {error.hung} hung (their stacks are on stderr)" if error.hung else ""
    return _failure(f"{head}: ranks {sorted(error.tracebacks)} failed{hung}", failed, suspects)


def _failure(first_line: str, tracebacks: dict[str, str], causes: list[str]) -> str:
    with tempfile.NamedTemporaryFile("w", prefix="ddp_check-", suffix=".log", delete=False) as f:
        f.write("\n".join(f"--- {where}:\n{text}" for where, text in tracebacks.items()))
    where, text = next(iter(tracebacks.items()))
    errors = [line for line in text.rstrip().splitlines() if "Error" in line]
    tail = [line[:200] for line in text.rstrip().splitlines()[-_TRACEBACK_LINES:]]
    lines = [first_line, *(_cause(c) for c in causes), (errors or tail)[-1][:300],
             f"{where}'s traceback, last lines:", *(f"  {line}" for line in tail),
             f"every failed run's whole traceback: {f.name}"]
    return "\n".join(lines) + _devices_hint("\n".join(tracebacks.values()))


# How torch says it found no GPU to use: GPUs hidden (the check's ranks), a CPU build, and a CUDA build on a
# machine without a working driver (pip's default torch on a CPU host or a login node).
_NO_GPU_ERRORS = ("No CUDA GPUs are available", "not compiled with CUDA", "Found no NVIDIA driver",
                  "NVIDIA driver on your system is too old", "CUDA driver initialization failed")


def _devices_hint(error: str) -> str:
    """What to do when a rank's error says it looked for a GPU: the check's ranks are CPU processes."""
    if not any(message in error for message in _NO_GPU_ERRORS):
        return ""
    return ("\nThe check's ranks are CPU processes: leave devices and autocast to it. Write the step without "
            ".cuda(), .to('cuda') or autocast('cuda'): the check's model and batches are on the CPU, and its "
            "mixed_precision= runs the step under CPU autocast.")


# ------------------------------ Bad input: before any process starts ---------------------------------


def _accums(accum: int | Callable[[], int], world_sizes: tuple[int, ...], batch_size: int) -> dict[int, int]:
    """The accumulation count at each world size; a formula must keep the global batch."""
    if not world_sizes or not all(map(_counting, world_sizes)):
        raise ValueError(f"world_sizes must be integers >= 1, got: {world_sizes!r}")
    counts = {world: _accum_for(accum, world) for world in world_sizes}
    global_batches = {world: count * world * batch_size for world, count in counts.items()}
    if callable(accum) and len(set(global_batches.values())) > 1:
        raise AssertionError(f"the accumulation formula changes the global batch (batch_size x accum x world size) "
                             f"with the world size: {global_batches}; likely cause: it divides by a count of one "
                             "node's GPUs (torch.cuda.device_count(), LOCAL_WORLD_SIZE; here 1 process per node) "
                             "instead of the world size (WORLD_SIZE, dist.get_world_size())")
    return counts


def _accum_for(accum: int | Callable[[], int], world: int) -> int:
    """The accumulation count at ``world``: an int, or the user's formula evaluated as on ``world`` nodes of one
    process each (where torch.cuda.device_count() and LOCAL_WORLD_SIZE count one node's GPUs, not the world)."""
    if not callable(accum):
        if not _counting(accum):
            raise ValueError(f"accum must be an integer >= 1 or a function returning one, got: {accum!r}")
        return accum
    saved = {name: os.environ.get(name) for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK")}
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    try:
        count = accum()
    except ZeroDivisionError as e:
        raise AssertionError(f"the accumulation formula divided by zero at world size {world} ({e}); likely cause: "
                             "it counts GPUs with torch.cuda.device_count() (0 here, and one node's only on a "
                             "cluster): compute it from the world size (WORLD_SIZE, dist.get_world_size())") from e
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if not _counting(count):
        raise AssertionError(f"the accumulation formula returned {count!r} at world size {world}: it must be an "
                             "integer >= 1; likely cause: it divides by a count of one node's GPUs "
                             "(torch.cuda.device_count(), LOCAL_WORLD_SIZE) instead of the world size")
    return count


def _check_inputs(front: str, spec: _Spec, world_sizes: tuple[int, ...],
                  accums: dict[int, int]) -> tuple[nn.Module, Any]:
    """ValueError/TypeError naming the bad value and the fix; returns the model (for the suspects) and the data,
    built once here (a user's make_data may load files; every rank builds its own)."""
    for arg in ("make_model", "make_data", "train_step", "make_optimizer", "after_ddp"):
        if arg != "train_step" or spec.own_step:  # assert_ddp_equivalent checked loss_fn
            _check_importable(arg, getattr(spec, arg))
    for arg in ("steps", "batch_size"):
        value = getattr(spec, arg)
        if not _counting(value):
            raise ValueError(f"{arg} must be an integer >= 1, got: {value!r}")
    options = set(inspect.signature(DDP.__init__).parameters) - {"self", "module", "device_ids", "output_device",
                                                                  "process_group", "device_mesh"}
    if unknown := sorted(dict(spec.ddp_options).keys() - options):
        raise TypeError(f"{front} got unknown keyword(s) {unknown}; besides its own it takes "
                        f"DistributedDataParallel's options: {', '.join(sorted(options))}")
    torch.manual_seed(spec.seed)
    model = spec.make_model()
    if not isinstance(model, nn.Module):
        raise TypeError(f"make_model() must return a torch.nn.Module, got: {type(model).__name__}; return "
                        "the model itself (not a tuple, a state dict or a DDP wrapper built inside)")
    data = spec.make_data()
    size = len(data)
    needed = max(world * spec.batch_size * spec.steps * accums[world] for world in world_sizes)
    if size < needed:
        raise ValueError(f"make_data() returned {size} samples, fewer than world size x batch_size x steps x accum "
                         f"= {needed}: the ranks would train on padded repeats; return at least {needed} samples, "
                         "or pass smaller world_sizes, batch_size, steps or accum")
    if spec.disable_dropout:
        return _without_dropout(model), data
    return model, data


def _counting(value: Any) -> bool:
    """Whether ``value`` is a count of at least one: an int, not a bool (True is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_importable(arg: str, fn: Any) -> None:
    if fn is None and arg == "after_ddp":
        return
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<lambda>" in qualname or "<locals>" in qualname:
        raise ValueError(f"{arg} must be a top-level function of an importable module, got: {fn!r}; the "
                         "ranks are separate processes that import it by name: define it with `def` at module "
                         "level (functools.partial of such a function works too)")
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise ValueError(f"{arg} cannot be sent to the ranks (pickling failed: {e}), got: {fn!r}; define it "
                         "with `def` at the top level of a module") from e


# ------------------------------ Worker pools: real gloo processes, reused ----------------------------


class PoolError(AssertionError):
    """A task failed or hung on some rank; the message holds every rank's report, ``tracebacks`` the
    failed ranks' by rank (at a hang, those of the ranks that replied: often the root cause), ``hung`` the ranks
    that did not reply in time."""

    def __init__(self, message: str, tracebacks: dict[int, str] | None = None, hung: list[int] | None = None):
        super().__init__(message)
        self.tracebacks = tracebacks or {}
        self.hung = hung or []


class WorkerPool:
    """``world`` real processes in one gloo group, each serving tasks over a pipe, one thread each.

    Started as launch() starts its workers (distributed.start_workers): they die with this process,
    and nothing listens on the network.
    """

    def __init__(self, world: int):
        self.world = world
        pipes = [mp.get_context("spawn").Pipe() for _ in range(world)]
        self.conns = [parent for parent, _ in pipes]
        self.workers = distributed.start_workers(_serve, world, [child for _, child in pipes],
                                                 env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
        for _, child in pipes:
            child.close()

    def run(self, task: Callable[[Any], Any], spec: Any, timeout: float | None = None) -> list:
        """Run ``task(spec)`` on every rank; return the per-rank results in rank order."""
        timeout = TIMEOUT_S if timeout is None else timeout
        for conn in self.conns:
            conn.send((task, spec, timeout))
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple] = {}
        while len(replies) < self.world:
            waiting = {self.conns[r]: r for r in range(self.world) if r not in replies}
            ready = multiprocessing.connection.wait(list(waiting), max(deadline - time.monotonic(), 0))
            if not ready:  # a rank that failed first (a timed-out collective, say) says why the others wait
                errors = {r: payload for r, (status, payload) in replies.items() if status == "error"}
                report = "".join(f"\n--- rank {r}, which replied:\n{tb}" for r, tb in sorted(errors.items()))
                raise PoolError(f"{task.__name__} did not finish within {timeout:.0f} s on ranks "
                                f"{sorted(waiting.values())} (world {self.world}): a hang; their stacks are on "
                                f"stderr{report}", errors, sorted(waiting.values()))
            for conn in ready:
                try:
                    replies[waiting[conn]] = conn.recv()
                except EOFError:
                    code = self.workers.processes[waiting[conn]].exitcode
                    replies[waiting[conn]] = ("error", f"worker process died (exit code {code})")
        errors = {r: payload for r, (status, payload) in replies.items() if status == "error"}
        if errors:
            report = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items()))
            raise PoolError(f"{task.__name__} failed on ranks {sorted(errors)} (world {self.world}):\n"
                            f"{report}", errors)
        return [replies[r][1] for r in range(self.world)]

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        self.workers.close()


class WorkerPools:
    """One pool per world size, started on first use and restarted after any failure."""

    def __init__(self):
        self.pools: dict[int, WorkerPool] = {}

    def run(self, world: int, task: Callable[[Any], Any], spec: Any, timeout: float | None = None) -> list:
        if world not in self.pools:
            self.pools[world] = WorkerPool(world)
        try:
            return self.pools[world].run(task, spec, timeout)
        except BaseException:
            self.pools.pop(world).close()
            raise

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


@functools.cache
def worker_pools() -> WorkerPools:
    """This Python process's pools (one per world size), shared by every call; stopped at exit."""
    pools = WorkerPools()
    atexit.register(pools.close)
    return pools


def _serve(rank: int, world: int, conns: list) -> None:
    """A pool worker's main: join the group once, then run tasks until told to stop."""
    conn = conns[rank]
    distributed.init_process_group(rank, world, backend="gloo", timeout=_GROUP_TIMEOUT_S)
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            if message is None:
                return
            task, spec, timeout = message
            # Where a hung task is, on stderr, before the pool gives up on it and restarts (a task that ends
            # within 90% of its timeout prints nothing).
            faulthandler.dump_traceback_later(0.9 * timeout)
            try:
                conn.send(("ok", task(spec)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
            finally:
                faulthandler.cancel_dump_traceback_later()
    finally:
        distributed.cleanup()

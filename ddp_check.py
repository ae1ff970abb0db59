"""Check your own model: does DDP training equal 1-process training? Copy next to distributed.py.

    # test_my_model.py                          (top-level callables: ranks are separate processes)
    from ddp_check import assert_ddp_equivalent
    from my_project import make_model, make_data, loss_fn

    def test_my_model_trains_the_same_under_ddp():
        assert_ddp_equivalent(make_model, make_data, loss_fn)

For each world size W, W real gloo processes on this machine train ``steps`` steps through DDP and
distributed.data_sampler, in float64, and one process trains on the union of their batches. The
first step's gradients, then every parameter and buffer after every step, must match the one
process, and the replicas must be bitwise equal to each other. A divergence is an AssertionError
naming the world size, the step, the first diverging tensor, the errors, and the likely cause.

Tolerance: rtol = 1e-7, and atol = 1e-7 x the reference tensor's largest magnitude (at least 1).
In float64 the only honest difference is the order of the all-reduce's sums (~1e-16 relative).
Adaptive optimizers (Adam) divide by sqrt(v) + eps, which amplifies the rounding of a near-zero
gradient up to lr / eps times; with float64 and eps >= 1e-8 that stays below 1e-10 over a few steps
(measured in this project's suite), so 1e-7 keeps three orders of magnitude of margin on both
sides: every cause named below diverges by 1e-3 or more.

Worker pools are started once per world size and reused by every call in this Python process
(the first call takes a few seconds), stopped at exit; a rank that hangs fails the call after
TIMEOUT_S seconds.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import multiprocessing.connection
import os
import pickle
import tempfile
import time
import traceback
from typing import Any
from collections.abc import Callable

import torch
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.data.dataloader import default_collate

import distributed

__all__ = ["assert_ddp_equivalent", "assert_step_equivalent", "check_equivalence", "worker_pools", "WorkerPools",
           "PoolError", "TIMEOUT_S"]

TIMEOUT_S = 60.0            # a call that takes longer on some rank is a hang: its pool is restarted
_GROUP_TIMEOUT_S = 30.0     # a collective stuck this long fails inside the ranks too
_RTOL = 1e-7
_TRACEBACK_LINES = 8        # of the first failed rank's, in a report; the whole text goes to a file


def assert_ddp_equivalent(make_model: Callable[[], nn.Module], make_data: Callable[[], Any],
                          loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
                          make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
                          world_sizes: tuple[int, ...] = (2, 3), steps: int = 3, batch_size: int = 4,
                          seed: int = 0, disable_dropout: bool = False, **ddp_options: Any) -> None:
    """Raise AssertionError if DDP training of ``make_model()`` differs from 1-process training.

    make_model(): an nn.Module, built after torch.manual_seed(seed) in the reference and every rank.
    make_data(): a map-style Dataset whose items (tensors, or tuples, lists or dicts of them) the
    default collate can batch. loss_fn(model, batch): the scalar loss of a batch (floating-point
    tensors in float64), as your training code computes it. make_optimizer(params): an optimizer
    (default: SGD, lr 0.1). All four must be top-level functions of an importable module.
    disable_dropout=True: every dropout probability set to 0 for the check (nn.Dropout and its
    variants, nn.MultiheadAttention's), since random masks cannot match one process's. Dropout
    itself is then unchecked, and so is a probability kept as a plain number and passed to a
    function (F.dropout, scaled_dot_product_attention's dropout_p): set that to 0 in make_model.
    ddp_options: passed to every rank's DDP(...), as in your training code (find_unused_parameters=True,
    forward_sync_buffers=False, gradient_as_bucket_view=True, static_graph=True, ...; torch 2.13 deprecates
    broadcast_buffers, and static_graph fails with no_sync accumulation: pytorch/pytorch#143580).
    """
    check_equivalence(make_model, make_data, loss_fn, make_optimizer or _sgd, world_sizes=world_sizes,
                      steps=steps, batch_size=batch_size, seed=seed, disable_dropout=disable_dropout,
                      ddp_options=ddp_options)


def check_equivalence(make_model: Callable, make_data: Callable, loss_fn: Callable, make_optimizer: Callable,
                      *, world_sizes: tuple[int, ...], steps: int, batch_size: int, seed: int, accum: int = 1,
                      epoch: int = 0, shuffle: bool = True, after_ddp: Callable | None = None,
                      rtol: float = _RTOL, disable_dropout: bool = False,
                      ddp_options: dict | None = None) -> dict[int, list[dict]]:
    """assert_ddp_equivalent's engine, with the knobs this project's own tests vary: ``accum``
    micro-batches per step (all but the last under no_sync), the sampler's ``epoch`` and
    ``shuffle``, ``after_ddp(ddp_model)`` run on every rank after wrapping (a comm hook), and the
    tolerance. Returns every world size's per-rank records."""
    spec = {"make_model": make_model, "make_data": make_data, "loss_fn": loss_fn,
            "make_optimizer": make_optimizer, "steps": steps, "batch": batch_size, "seed": seed,
            "accum": accum, "epoch": epoch, "shuffle": shuffle, "after_ddp": after_ddp,
            "disable_dropout": disable_dropout, "ddp_options": dict(ddp_options or {})}
    model = _check_inputs(spec, world_sizes)
    suspects = _suspects(model) + _data_suspects(spec["make_data"])
    records = {}
    for world in world_sizes:
        reference = _train_reference(spec, world)
        try:
            records[world] = worker_pools().run(world, _train_rank, spec)
        except PoolError as e:
            raise AssertionError(_rank_failure(world, e, suspects)) from None
        _compare(world, records[world], reference, suspects, rtol)
    return records


# ------------------------------ Your whole step: accumulation, scaling, clipping -------------
_SCALE = 2.0 ** 10        # the second loss scale: a power of two, exact in float64
_MIXED_RTOL = 0.1         # bf16 smoke test: each gradient's error norm within 10% of its norm (see below)


def assert_step_equivalent(make_model: Callable[[], nn.Module], make_data: Callable[[], Any],
                           train_step: Callable[..., Any], *,
                           make_optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
                           world_sizes: tuple[int, ...] = (2, 3), accum: int | Callable[[], int] = 2,
                           batch_size: int = 2, steps: int = 3, seed: int = 0, disable_dropout: bool = False,
                           mixed_precision: bool = False, compile_model: str | None = None,
                           accept_sync_every_micro_step: bool = False, **ddp_options: Any) -> None:
    """Raise AssertionError, naming the likely cause, when ``train_step`` trains differently under DDP than in one
    process: the DDP bugs that live in a loop's step (accumulation, loss scaling, clipping), not in the model.

    train_step(model, optimizer, scaler, micro_batches, step): one optimizer step copied from your loop. ``model``
    is the DDP-wrapped model, ``micro_batches`` a list of ``accum`` batches of ``batch_size`` samples for this
    rank (collated as assert_ddp_equivalent does), ``scaler`` a torch.amp.GradScaler the step must use if it
    scales the loss (the check chooses its scale), ``step`` the step index (for your LR schedule). What
    assert_ddp_equivalent says of top-level callables, float64 and the tolerance holds here too.

    Four runs per world size W localise a difference: W ranks through DDP; one process with the same
    micro-batch structure (each micro-batch the union of the ranks'); the same at a second loss scale; one
    process on the whole batch at once. A hook on DDP's all-reduce records which micro-step synchronised and
    the gradients it averaged (before any clipping), and every parameter's gradient hook which got none.
    accum: an int, or a zero-argument function computing it as your script does: it is evaluated for each
    world size with WORLD_SIZE set and one process per node (LOCAL_WORLD_SIZE=1, no GPU), and must keep the
    global batch (batch_size x accum x W) the same. mixed_precision=True: a smoke test of the model in float32
    under torch.autocast("cpu", dtype=torch.bfloat16), comparing only the first step's gradients, each
    tensor's error norm within 10% of its norm (bf16 rounds to 3 significant digits: 1% per tensor is ordinary
    between 1 and N processes, and every bug named here is 25% or more). compile_model: "before_ddp" or
    "after_ddp": torch.compile (backend "eager") where your script calls it. accept_sync_every_micro_step=True:
    a step whose every micro-step all-reduces (right values, accum x the traffic) passes. ddp_options: to DDP.
    """
    spec = {"make_model": make_model, "make_data": make_data, "loss_fn": None, "train_step": train_step,
            "make_optimizer": make_optimizer or _sgd, "steps": steps, "batch": batch_size, "seed": seed,
            "accum": 1, "epoch": 0, "shuffle": True, "after_ddp": None, "disable_dropout": disable_dropout,
            "ddp_options": dict(ddp_options), "mixed_precision": mixed_precision, "compile_model": compile_model}
    if compile_model not in (None, "before_ddp", "after_ddp"):
        raise ValueError(f"compile_model must be None, 'before_ddp' or 'after_ddp', got: {compile_model!r}")
    counts = {world: _accum_for(accum, world, batch_size) for world in world_sizes}
    global_batches = {world: count * world * batch_size for world, count in counts.items()}
    if callable(accum) and len(set(global_batches.values())) > 1:
        raise AssertionError(f"the accumulation formula changes the global batch (batch_size x accum x world size) "
                             f"with the world size: {global_batches}; likely cause: it divides by a count of one "
                             "node's GPUs (torch.cuda.device_count(), LOCAL_WORLD_SIZE; here 1 process per node) "
                             "instead of the world size (WORLD_SIZE, dist.get_world_size())")
    spec["accum"] = max(counts.values())  # _check_inputs: enough samples for the largest
    model = _check_inputs(spec, world_sizes)
    data_causes = _data_suspects(make_data)  # reads the data: once, not at every world size
    suspects = _suspects(model) + data_causes
    for world in world_sizes:
        spec["accum"] = counts[world]
        runs = {}
        for name, ranks, scale, whole in (("ddp", world, 1.0, False), ("micro", 1, 1.0, False),
                                          ("scaled", 1, _SCALE, False), ("whole", 1, 1.0, True)):
            plan = _step_plan(spec, world, ranks, whole)
            try:
                runs[name] = worker_pools().run(ranks, _step_rank, {**spec, "plan": plan, "scale": scale})
            except PoolError as e:
                raise AssertionError(_rank_failure(world, e, suspects)) from None
        problem = _step_problem(world, runs, spec, suspects, data_causes, accept_sync_every_micro_step)
        if problem:
            raise AssertionError(problem)


def _accum_for(accum: int | Callable[[], int], world: int, batch_size: int) -> int:
    """The accumulation count at ``world``: an int, or the user's formula evaluated as on ``world`` nodes of one
    process each (where torch.cuda.device_count() and LOCAL_WORLD_SIZE count one node's GPUs, not the world)."""
    if not callable(accum):
        if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
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
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise AssertionError(f"the accumulation formula returned {count!r} at world size {world}: it must be an "
                             "integer >= 1; likely cause: it divides by a count of one node's GPUs "
                             "(torch.cuda.device_count(), LOCAL_WORLD_SIZE) instead of the world size")
    return count


def _step_plan(spec: dict, world: int, ranks: int, whole: bool) -> list:
    """Each rank's micro-batches' indices, per step: the W ranks' own shards; one process's micro-batch m the
    union of the ranks' m-th (``whole``: all of a step's in one batch)."""
    data = spec["make_data"]()
    shards = [_shard(data, world, rank, spec) for rank in range(world)]
    size, accum = spec["batch"], spec["accum"]
    plan = []
    for rank in range(ranks):
        steps = []
        for step in range(spec["steps"]):
            micro = [[shards[r][(step * accum + m) * size + i] for r in range(world) if ranks == 1 or r == rank
                      for i in range(size)] for m in range(accum)]
            steps.append([sum(micro, [])] if whole else micro)
        plan.append(steps)
    return plan


def _step_rank(spec: dict) -> dict:
    """On every rank of a pool: the user's step through DDP on the plan's micro-batches, recording which
    micro-steps all-reduced, the averaged gradients, the parameters after each step, and unused parameters."""
    rank = distributed.get_rank()
    model = _model(spec)
    if spec["mixed_precision"]:
        model = model.float()
    inner = torch.compile(model, backend="eager") if spec["compile_model"] == "before_ddp" else model
    ddp = DDP(inner, **spec["ddp_options"])
    wrapped = torch.compile(ddp, backend="eager") if spec["compile_model"] == "after_ddp" else ddp
    names = {p: name for name, p in model.named_parameters()}
    now = {"forwards": 0, "grads": {}, "got": set()}
    record: dict[str, Any] = {"syncs": [], "grads": [], "states": [], "unused": [], "error": None}
    model.register_forward_pre_hook(lambda *_: now.update(forwards=now["forwards"] + 1))
    for p in names:
        p.register_post_accumulate_grad_hook(lambda p: now["got"].add(names[p]))

    def recording_allreduce(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
        now["syncs"].add(now["forwards"])

        def keep(future: Any) -> torch.Tensor:
            flat, start = future.value(), 0
            for p in bucket.parameters():
                now["grads"][names[p]] = flat[start:start + p.numel()].view_as(p).clone() / now["scale"]
                start += p.numel()
            return flat
        return default_hooks.allreduce_hook(None, bucket).then(keep)
    ddp.register_comm_hook(None, recording_allreduce)
    data = spec["make_data"]()
    optimizer = spec["make_optimizer"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=spec["scale"], growth_interval=2 ** 30)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if spec["mixed_precision"] else contextlib.nullcontext()
    for step, micro in enumerate(spec["plan"][rank]):
        batches = [default_collate([data[i] for i in indices]) for indices in micro]
        if not spec["mixed_precision"]:
            batches = [_float64(batch) for batch in batches]
        now.update(forwards=0, grads={}, got=set(), syncs=set(), scale=scaler.get_scale())
        try:
            with autocast:
                spec["train_step"](wrapped, optimizer, scaler, batches, step)
        except Exception:
            record["error"] = traceback.format_exc()
            break
        record["syncs"].append(sorted(now["syncs"]))
        record["grads"].append(now["grads"])
        record["states"].append(_state(model))
        record["unused"].append(sorted(set(names.values()) - now["got"]))
    return record


def _devices_hint(error: str) -> str:
    """What to do when a rank's error says it looked for a GPU: the check's ranks are CPU processes."""
    if "No CUDA GPUs are available" not in error and "not compiled with CUDA" not in error:
        return ""
    return ("\nThe check's ranks are CPU processes: leave devices and autocast to it. Write the step without "
            ".cuda(), .to('cuda') or autocast('cuda'): the check's model and batches are on the CPU, and its "
            "mixed_precision= runs the step under CPU autocast.")


def _step_problem(world: int, runs: dict, spec: dict, suspects: list[str], data_causes: list[str],
                  accept_every: bool) -> str | None:
    """The first difference among the four runs, with the cause it points to; None when they agree."""
    ddp, micro, scaled, whole = runs["ddp"], runs["micro"][0], runs["scaled"][0], runs["whole"][0]
    accum = spec["accum"]
    head = f"the step trains differently under DDP: world size {world}, accum {accum}, batch_size {spec['batch']}"
    failed = [(rank, r) for rank, r in enumerate([*ddp, micro]) if r["error"]]
    if failed:
        rank, record = failed[0]
        step = len(record["syncs"]) + 1  # the step that raised, from 1
        where = f"rank {rank}" if rank < len(ddp) else "one process"
        lines = [f"{head}: step {step} raised on {where}"]
        unused = record["unused"][-1] if record["unused"] else []
        if unused:
            if accum > 1:
                safe = "not static_graph=True: with no_sync accumulation it fails, pytorch/pytorch#143580"
            elif all(u == unused for u in record["unused"]):
                safe = "static_graph=True fits too: the same set is unused at every step"
            else:
                safe = "not static_graph=True: the set unused changes from step to step"
            lines.append(_cause(f"{_first_few([f'`{n}`' for n in unused])} got no gradient at step {step - 1} on "
                                f"{where} (DDP waits for every parameter): pass find_unused_parameters=True ({safe}), "
                                "or make them take part"))
        errors = [line for line in record["error"].rstrip().splitlines() if "Error" in line]
        lines.append((errors or record["error"].rstrip().splitlines())[-1][:300])
        return "\n".join(lines) + _devices_hint(record["error"])
    for step, syncs in enumerate(ddp[0]["syncs"], 1):
        if syncs == list(range(1, accum + 1)) and accum > 1 and not accept_every:
            return (f"{head}: every micro-step of step {step} all-reduced ({syncs}), not only the last: the values "
                    f"are right but it costs {accum}x the traffic\n" + _cause(
                        "no_sync() around the backward only: DDP decides at the forward whether a backward "
                        "all-reduces, so put the forward inside no_sync() too (or pass "
                        "accept_sync_every_micro_step=True)"))
        if syncs != [accum] and syncs != list(range(1, accum + 1)):
            return (f"{head}: at step {step} DDP all-reduced at micro-step(s) {syncs or 'none'} of {accum}, not "
                    "at the last\n" + _cause(
                        "the sync flag decided after the forward (require_backward_grad_sync set between forward "
                        "and backward): DDP decides at the forward, so set it before the forward of each "
                        "micro-step (True on the last), or run the other micro-steps' forward and backward "
                        "inside no_sync()"))
    if data_causes:  # else blamed on accumulation, as a factor near 1
        return f"{head}\n" + "\n".join(_cause(c) for c in data_causes)
    tolerance = _MIXED_RTOL if spec["mixed_precision"] else None
    if not spec["mixed_precision"]:
        for step, (a, b) in enumerate(zip(micro["states"], scaled["states"], strict=False), 1):
            if any(not torch.equal(a[n], b[n]) for n in a):
                return (f"{head}: at step {step}, one process trains differently at loss scale {_SCALE:g} than at "
                        "1 (in float64 a power-of-two scale is exact)\n" + _cause(
                            "gradients used before scaler.unscale_(optimizer): clipping (clip_grad_norm_), a norm "
                            "or a check on scaled gradients; call scaler.unscale_(optimizer) before clipping"))
    problem = _compare_steps(micro, whole, tolerance, 1 if tolerance else len(whole["states"]))
    if problem:
        factor = _factor(micro["grads"][0], whole["grads"][0])
        why = [f"one process with {accum} micro-batches differs from one batch of them all: {problem}"]
        if factor is not None and accum > 1 and abs(factor / accum - 1) < 0.05:
            why.append(_cause(f"the gradients are about {accum}x (the micro-batches) one batch's: divide each "
                              f"micro-batch's loss by their number ({accum}) before backward"))
        return "\n".join([head, *why, *(_cause(c) for c in suspects)])
    for step, states in enumerate(zip(*[r["states"] for r in ddp], strict=True), 1):
        for rank, other in enumerate(states[1:], 1):
            if any(not torch.equal(other[n], states[0][n]) for n in states[0]):
                return (f"{head}: after step {step} rank {rank}'s parameters differ from rank 0's\n" +
                        "\n".join(_cause(c) for c in [*suspects, "a step whose ranks diverge: DDP averages "
                                                       "gradients only where it all-reduces"]))
    problem = _compare_steps(ddp[0], micro, tolerance, 1 if tolerance else len(micro["states"]))
    if problem:
        return "\n".join([head, f"DDP differs from one process with the same micro-batches: {problem}",
                          *(_cause(c) for c in suspects)])
    return None


def _compare_steps(got: dict, expected: dict, relative: float | None, steps: int) -> str | None:
    """The first gradient (step 1) or parameter that differs: within _RTOL, or (``relative``) by norm."""
    for name, ref in expected["grads"][0].items():
        value = got["grads"][0].get(name)
        if value is None or not _close(value, ref, relative):
            return f"the gradient of `{name}` at step 1"
    if relative is not None:
        return None
    for step in range(steps):
        for name, ref in expected["states"][step].items():
            if not _close(got["states"][step][name], ref, None):
                return f"`{name}` after step {step + 1}"
    return None


def _close(a: torch.Tensor, b: torch.Tensor, relative: float | None) -> bool:
    if relative is not None:
        return bool((a.float() - b.float()).norm() <= relative * b.float().norm() + 1e-12)
    return bool(torch.allclose(a, b, rtol=_RTOL, atol=_RTOL * max(1.0, b.abs().max())))


def _factor(got: dict, expected: dict) -> float | None:
    """The factor c that best fits got = c x expected over every gradient (None when they are zero)."""
    names = [n for n in expected if n in got]
    if not names:
        return None
    return _scale(torch.cat([got[n].flatten() for n in names]), torch.cat([expected[n].flatten() for n in names]))


# ------------------------------ Training: the ranks and the reference ------------------------


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _train_rank(spec: dict) -> dict:
    """On every rank: DDP over this rank's shard; the records _compare reads."""
    model = _model(spec)
    ddp = DDP(model, **spec["ddp_options"])
    if spec["after_ddp"] is not None:
        spec["after_ddp"](ddp)
    data = spec["make_data"]()
    sampler = distributed.data_sampler(data, True, spec["shuffle"], seed=spec["seed"])
    sampler.set_epoch(spec["epoch"])
    batches = iter(DataLoader(data, batch_size=spec["batch"], sampler=sampler))
    optimizer = spec["make_optimizer"](model.parameters())
    record: dict[str, Any] = {"states": []}
    for step in range(spec["steps"]):
        for micro in range(spec["accum"]):
            local = micro < spec["accum"] - 1  # micro-batches before the last stay local: no all-reduce
            with ddp.no_sync() if local else contextlib.nullcontext():
                (spec["loss_fn"](ddp, _float64(next(batches))) / spec["accum"]).backward()
            if step == 0 and micro == 0:
                record["first_micro_grads"] = _grads(model)
        _step(model, optimizer, step, record)
    return record


def _train_reference(spec: dict, world: int) -> dict:
    """One process on the union of the ranks' batches: world x batch x accum samples a step."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank: the same kernels
    try:
        model = _model(spec)
        data = spec["make_data"]()
        if hasattr(data, "set_epoch"):  # distributed.seeded_dataset's: the ranks' data_sampler sets it too
            data.set_epoch(spec["epoch"])
        shards = [_shard(data, world, rank, spec) for rank in range(world)]
        per_step = spec["batch"] * spec["accum"]
        optimizer = spec["make_optimizer"](model.parameters())
        record: dict[str, Any] = {"states": []}
        for step in range(spec["steps"]):
            indices = [i for shard in shards for i in shard[step * per_step:(step + 1) * per_step]]
            spec["loss_fn"](model, _float64(default_collate([data[i] for i in indices]))).backward()
            _step(model, optimizer, step, record)
        return record
    finally:
        torch.set_num_threads(before)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, record: dict) -> None:
    """After a step's backward: keep the first step's gradients, step, keep every tensor's state."""
    if step == 0:
        record["grads"] = _grads(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    record["states"].append(_state(model))


def _shard(data: Any, world: int, rank: int, spec: dict) -> list[int]:
    """Rank ``rank``'s indices in order, as torch's DistributedSampler gives them (no group needed)."""
    sampler = DistributedSampler(data, world, rank, shuffle=spec["shuffle"], seed=spec["seed"])
    sampler.set_epoch(spec["epoch"])
    return list(sampler)


def _model(spec: dict) -> nn.Module:
    torch.manual_seed(spec["seed"])
    model = spec["make_model"]().double()
    return _without_dropout(model) if spec["disable_dropout"] else model


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


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: t.detach().clone() for name, t in named}


# ------------------------------ Comparing, and naming the likely cause -----------------------


def _compare(world: int, ranks: list[dict], reference: dict, suspects: list[str], rtol: float) -> None:
    """The first step's gradients, then each step's parameters and buffers: replicas bitwise
    equal to rank 0, rank 0 close to the reference. Raises at the first divergence."""
    checks = [("the gradient of `{}`", 1, [r["grads"] for r in ranks], reference["grads"])]
    checks += [("`{}` after the optimizer step", step + 1, [r["states"][step] for r in ranks], expected)
               for step, expected in enumerate(reference["states"])]
    for what, step, per_rank, expected in checks:
        for name, got in per_rank[0].items():
            for rank, other in enumerate(per_rank[1:], 1):
                if not torch.equal(other[name], got):
                    raise AssertionError(_report(world, step, what.format(name), got, other[name],
                                                 suspects, f"rank {rank} differs from rank 0", replicas=True))
            ref = expected.get(name)
            if ref is None or not torch.allclose(got, ref, rtol=rtol, atol=rtol * max(1.0, ref.abs().max())):
                raise AssertionError(_report(world, step, what.format(name), ref, got, suspects,
                                             "rank 0 differs from one process", replicas=False))


def _report(world: int, step: int, where: str, expected: torch.Tensor | None, got: torch.Tensor,
            suspects: list[str], how: str, replicas: bool) -> str:
    lines = [f"DDP diverges from 1-process training: world size {world}, step {step}, {where} ({how})"]
    if expected is None:
        lines.append("  one process has no such tensor (a gradient that only DDP computed?)")
    else:
        error = (got - expected).abs()
        relative = torch.where(expected != 0, error / expected.abs(), 0.0)  # where one process has 0: none
        lines.append(f"  largest absolute error {error.max().item():.3g}, largest relative error "
                     f"{relative.max().item():.3g}")
        factor = _scale(got, expected)
        if not replicas and factor is not None and abs(factor * world - 1) < 0.05 and world > 1:
            lines.append(_cause(f"the gradients are about 1/{world} (the world size) of one process's: DDP "
                                "averages gradients over ranks, so the loss must be the batch mean. A summed "
                                "loss, or a sum divided by a per-rank count, gives 1/world"))
        if not replicas and factor is not None and abs(factor / world - 1) < 0.05 and world > 1:
            lines.append(_cause(f"the gradients are about {world}x (the world size) one process's: DDP "
                                "already averages over ranks; do not multiply the loss by the world size"))
    lines += [_cause(c) for c in suspects]
    if replicas:
        lines.append(_cause("replicas that differ from each other: DDP keeps parameters equal by averaging "
                            "gradients and broadcasts rank 0's buffers only at the start of each forward, so "
                            "a buffer or parameter changed from a rank's own data (or rank-dependent code) "
                            "drifts apart"))
    return "\n".join(lines)


def _cause(text: str) -> str:
    return f"  likely cause: {text}"


def _scale(got: torch.Tensor, expected: torch.Tensor) -> float | None:
    """The factor c that best fits got = c x expected (None when expected is zero)."""
    norm = (expected * expected).sum().item()
    return (got * expected).sum().item() / norm if norm > 0 else None


def _suspects(model: nn.Module) -> list[str]:
    """What in the model is known to make DDP differ from one process: one cause each, naming modules."""
    batchnorms, dropouts = [], []
    for name, module in model.named_modules():
        where = f"`{name or '(the model)'}` ({type(module).__name__}"
        synced = isinstance(module, nn.SyncBatchNorm) or getattr(module, "synchronized", False)
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not synced:
            batchnorms.append(where + ")")
        p = module.p if isinstance(module, nn.modules.dropout._DropoutNd) else \
            module.dropout if isinstance(module, nn.MultiheadAttention) else 0.0
        if p > 0:
            dropouts.append(f"{where}, p={p})")
    found = []
    if batchnorms:
        found.append(f"BatchNorm in {_first_few(batchnorms)} normalizes each rank's batch with that rank's "
                     "own statistics: convert the model with distributed.sync_batchnorm(model) before DDP (torch's "
                     "SyncBatchNorm on GPUs, an exact version on CPU processes), or use GroupNorm/LayerNorm")
    if dropouts:
        found.append(f"Dropout in {_first_few(dropouts)}: random masks cannot match one process's; pass "
                     "disable_dropout=True to check the rest of the model (dropout itself is then unchecked)")
    return found


def _data_suspects(make_data: Callable[[], Any]) -> list[str]:
    """Per-rank data randomness: an item that differs when read twice (a random augmentation drawing from
    torch's global generator) differs between the ranks and one process, however right the model is."""
    try:
        distributed.check_repeatable(make_data())
    except ValueError as e:
        return [str(e)]
    return []


def _first_few(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _rank_failure(world: int, error: PoolError, suspects: list[str]) -> str:
    """The causes, then one rank's traceback, trimmed (ranks raise alike); every rank's in a file."""
    if not error.tracebacks:  # a hang: the message names the ranks and the timeout
        return f"DDP training failed at world size {world}: {error}"
    with tempfile.NamedTemporaryFile("w", prefix="ddp_check-", suffix=".log", delete=False) as f:
        f.write(str(error))
    first = min(error.tracebacks)
    lines = [f"DDP training failed on ranks {sorted(error.tracebacks)} at world size {world}:"]
    if any("find_unused_parameters" in tb or "did not receive grad" in tb for tb in error.tracebacks.values()):
        lines.append(_cause("parameters that get no gradient in some step (unused parameters): DDP waits "
                            "for every parameter's gradient; pass find_unused_parameters=True to "
                            "assert_ddp_equivalent, as to DDP in your training code, or remove them"))
    lines += [_cause(c) for c in suspects]
    tail = [line[:200] for line in error.tracebacks[first].rstrip().splitlines()[-_TRACEBACK_LINES:]]
    lines += [f"rank {first}'s traceback, last lines:", *(f"  {line}" for line in tail),
              f"every rank's whole traceback: {f.name}"]
    return "\n".join(lines)


# ------------------------------ Bad input: before any process starts -------------------------


def _check_inputs(spec: dict, world_sizes: tuple[int, ...]) -> nn.Module:
    """ValueError/TypeError naming the bad value and the fix; returns the model (for diagnosis)."""
    for arg in ("make_model", "make_data", "train_step" if "train_step" in spec else "loss_fn", "make_optimizer",
                "after_ddp"):
        _check_importable(arg, spec[arg])
    if not world_sizes or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in world_sizes):
        raise ValueError(f"world_sizes must be integers >= 1, got: {world_sizes!r}")
    for arg in ("steps", "batch", "accum"):
        if isinstance(spec[arg], bool) or not isinstance(spec[arg], int) or spec[arg] < 1:
            name = {"batch": "batch_size"}.get(arg, arg)
            raise ValueError(f"{name} must be an integer >= 1, got: {spec[arg]!r}")
    torch.manual_seed(spec["seed"])
    model = spec["make_model"]()
    if not isinstance(model, nn.Module):
        raise TypeError(f"make_model() must return a torch.nn.Module, got: {type(model).__name__}; return "
                        "the model itself (not a tuple, a state dict or a DDP wrapper built inside)")
    options = set(inspect.signature(DDP.__init__).parameters) - {"self", "module", "device_ids", "output_device",
                                                                  "process_group", "device_mesh"}
    if unknown := sorted(spec["ddp_options"].keys() - options):
        raise TypeError(f"assert_ddp_equivalent got unknown keyword(s) {unknown}; besides its own it takes "
                        f"DistributedDataParallel's options: {', '.join(sorted(options))}")
    needed = max(world_sizes) * spec["batch"] * spec["steps"] * spec["accum"]
    size = len(spec["make_data"]())
    if size < needed:
        raise ValueError(f"make_data() returned {size} samples, fewer than max(world_sizes) x batch_size x "
                         f"steps = {needed}: the ranks would train on padded repeats; return at least "
                         f"{needed} samples, or pass smaller world_sizes, batch_size or steps")
    return _without_dropout(model.double()) if spec["disable_dropout"] else model.double()


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


# ------------------------------ Worker pools: real gloo processes, reused --------------------


class PoolError(AssertionError):
    """A task failed or hung on some rank; the message holds every rank's report, ``tracebacks`` the
    failed ranks' by rank (a hang: none)."""

    def __init__(self, message: str, tracebacks: dict[int, str] | None = None):
        super().__init__(message)
        self.tracebacks = tracebacks or {}


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

    def run(self, task: Callable[[dict], Any], spec: dict, timeout: float | None = None) -> list:
        """Run ``task(spec)`` on every rank; return the per-rank results in rank order."""
        timeout = TIMEOUT_S if timeout is None else timeout
        for conn in self.conns:
            conn.send((task, spec))
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple] = {}
        while len(replies) < self.world:
            waiting = {self.conns[r]: r for r in range(self.world) if r not in replies}
            ready = multiprocessing.connection.wait(list(waiting), max(deadline - time.monotonic(), 0))
            if not ready:
                raise PoolError(f"{task.__name__} did not finish within {timeout:.0f} s on ranks "
                                f"{sorted(waiting.values())} (world {self.world}): a hang")
            for conn in ready:
                try:
                    replies[waiting[conn]] = conn.recv()
                except EOFError:
                    code = self.workers.processes[waiting[conn]].exitcode
                    replies[waiting[conn]] = ("error", f"worker process died (exit code {code})")
        errors = {r: payload for r, (status, payload) in replies.items() if status == "error"}
        if errors:
            report = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items()))
            report += _devices_hint(report)
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

    def run(self, world: int, task: Callable[[dict], Any], spec: dict, timeout: float | None = None) -> list:
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
            task, spec = message
            try:
                conn.send(("ok", task(spec)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        distributed.cleanup()

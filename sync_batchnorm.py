"""BatchNorm on the global batch, so that N processes train as one process does: copy it next to distributed.py
(optional).

    from sync_batchnorm import sync_batchnorm

    model = sync_batchnorm(model)          # on every rank, before DDP(model)
    ddp = DDP(model)

Plain BatchNorm under DDP normalizes each rank's batch with that batch's own statistics, and each rank's running
statistics drift apart (DDP broadcasts rank 0's buffers at each forward, so the others' are lost). sync_batchnorm
replaces every BatchNorm layer (any depth) with one whose training statistics are the global batch's:

- a layer on a GPU when converted becomes torch's own SyncBatchNorm (its fused CUDA kernels);
- any other becomes an exact version that works on the device its input is on (torch's refuses CPU input, and
  DDP refuses a CPU module that holds torch's): the global batch's mean, then its variance (two passes, as exact
  as one process's), each weighted by the ranks' sample counts (a rank may hold none); the backward sums the
  gradients over the ranks; the running mean and unbiased variance (momentum=None: the cumulative average)
  update as one process's would.

Evaluating with plain BatchNorm at N processes reports metrics of N different models: DDP broadcasts rank 0's
buffers at each training forward, then each rank's own batch moves its running statistics, so only rank 0's are
the saved model's. With sync_batchnorm every rank's are the same.

Weights, buffers and the training flag are kept (the same Parameters: an optimizer holding them stays valid). The
group is looked up when a layer runs: convert before or after init_process_group. In a world of one, and in eval
(as torch's: an evaluation on the primary alone must not wait for the others), a layer is exactly BatchNorm. It uses
only distributed.py's public names and torch; distributed.py does not import it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

import distributed

__all__ = ["sync_batchnorm"]


def sync_batchnorm(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every BatchNorm layer normalizing with the global batch's statistics; call it before
    DDP(model), on every rank. A model without BatchNorm comes back unchanged."""
    if isinstance(model, DistributedDataParallel):
        raise TypeError("sync_batchnorm: the model is already wrapped in DistributedDataParallel, whose buckets "
                        "hold the old layers; convert first, then wrap: DDP(sync_batchnorm(model))")
    if not isinstance(model, _BatchNorm) or isinstance(model, (torch.nn.SyncBatchNorm, _ExactSyncBatchNorm)):
        for name, child in model.named_children():
            converted = sync_batchnorm(child)
            if converted is not child:
                setattr(model, name, converted)
        return model
    on_gpu = any(t is not None and t.is_cuda for t in (model.weight, model.running_mean))
    kind = torch.nn.SyncBatchNorm if on_gpu else _ExactSyncBatchNorm
    layer = kind(model.num_features, model.eps, model.momentum, model.affine, model.track_running_stats)
    if model.affine:
        layer.weight, layer.bias = model.weight, model.bias
    layer.running_mean, layer.running_var = model.running_mean, model.running_var
    layer.num_batches_tracked = model.num_batches_tracked
    layer.train(model.training)
    return layer


class _ExactSyncBatchNorm(_BatchNorm):
    """sync_batchnorm's layer where torch's cannot run: in training, the global batch's mean, then its variance,
    each a sum all-reduced by _AllReduceSum, whose backward sums the gradients over the ranks."""

    synchronized = True  # what ddp_check reads: this layer's statistics are the global batch's

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D input")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or distributed.get_world_size() == 1:
            return super().forward(input)  # exactly BatchNorm, as torch's SyncBatchNorm in eval
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # the cumulative average, as BatchNorm's
                factor = 1.0 / float(self.num_batches_tracked)
        channels, dims = input.shape[1], [0, *range(2, input.dim())]
        shape = [1, channels] + [1] * (input.dim() - 2)
        # Statistics in float32 at least, as BatchNorm's kernels keep them: a bf16 sum of a global batch (autocast)
        # loses its mean, and a bf16 count is exact only up to 256.
        x = input.to(torch.promote_types(input.dtype, torch.float32))
        local = torch.cat([x.sum(dims), x.new_full((1,), x.numel() // max(channels, 1))])
        total = _AllReduceSum.apply(local)
        count = int(total[-1].detach())
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {input.shape} "
                             f"on this rank and {count} value(s) per channel in the global batch")
        mean = total[:-1] / count
        centered = x - mean.reshape(shape)
        var = _AllReduceSum.apply(centered.square().sum(dims)) / count
        out = centered * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
                self.running_var.mul_(1 - factor).add_(var.detach() * (count / (count - 1)) * factor)
        return out.to(input.dtype)


class _AllReduceSum(torch.autograd.Function):
    """A sum over the ranks that gradients flow through: every rank's loss depends on the sum, so each rank's input
    gets the sum of the ranks' gradients (torch.distributed.nn's all_reduce does this, deprecated in torch 2.13).
    distributed.reduce moves a CPU tensor through the GPU under nccl (a model kept on the CPU in a GPU job)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return distributed.reduce(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return distributed.reduce(grad)

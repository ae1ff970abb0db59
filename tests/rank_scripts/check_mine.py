"""ddp_check from a plain script (test_ddp_check.py): a correct loss, a summed one, the correct one again."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset
from ddp_check import assert_ddp_equivalent

def make_model():
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))

def make_data():
    return TensorDataset(torch.randn(48, 5, generator=torch.Generator().manual_seed(0)),
                         torch.arange(48) % 3)

def mean_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)

def sum_loss(model, batch):  # DDP averages gradients: a summed loss diverges from one process
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum")

if __name__ == "__main__":
    for loss_fn in (mean_loss, sum_loss, mean_loss):  # the later calls reuse the pools
        try:
            assert_ddp_equivalent(make_model, make_data, loss_fn)
            print("equivalent")
        except AssertionError as e:
            print("diverges:", str(e).splitlines()[0])

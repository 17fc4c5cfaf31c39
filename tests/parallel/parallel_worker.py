"""Subprocess for the distributed tests: 2 gloo CPU processes run DDP, FSDP2 and tensor-parallel checks.

Usage: python parallel_worker.py <out_dir>. Rank 0 writes ddp.pt, fsdp.pt, ddp_moe.pt, fsdp_moe.pt and tp.pt into out_dir.
"""

import faulthandler
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "trainer"))
from trainer_helpers import MOE, TokenWindows, config, tiny_model  # noqa: E402

from astrai.parallel import ColumnParallelLinear, RowParallelLinear, get_rank, spawn_parallel_fn  # noqa: E402
from astrai.parallel.wrap import full_model_state  # noqa: E402
from astrai.trainer import Trainer  # noqa: E402

STEPS = 3

# Runs in the spawned ranks too (they import this module): a rank that aborts in native code
# prints where it was. (An abort at exit with 'terminate called without an active exception'
# is gloo releasing work during finalisation: see cleanup_parallel.)
faulthandler.enable()


def train(out: Path, mode: str, moe: bool = False) -> None:
    name = f"{mode}_moe" if moe else mode
    cfg = config(out / name, batch_per_device=2, max_steps=STEPS, parallel_mode=mode, save_final_model=False,
                 ckpt_interval=STEPS)
    model = tiny_model(**MOE) if moe else tiny_model()
    context = Trainer(cfg, model=model, train_dataset=TokenWindows(n=32)).train()
    state = full_model_state(context.model)
    if get_rank() == 0:
        torch.save({"weights": state, "loss": context.loss}, out / f"{name}.pt")


def tensor_parallel(out: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    w1, w2 = torch.randn(12, 8), torch.randn(8, 12)
    column = ColumnParallelLinear(8, 12, gather_output=False).load_dense(w1)
    row = RowParallelLinear(12, 8, input_is_parallel=True).load_dense(w2)
    gathered = ColumnParallelLinear(8, 12, gather_output=True).load_dense(w1)
    y = row(torch.nn.functional.gelu(column(x)))
    y.square().sum().backward()
    dense_gathered = gathered(x.detach())
    grads = [torch.empty_like(w1) for _ in range(2)]
    dist.all_gather(grads, column.weight.grad.contiguous().repeat(2, 1))
    full_grad_w1 = torch.cat([g.chunk(2)[0] for g in grads])
    if get_rank() == 0:
        torch.save({"x": x.detach(), "w1": w1, "w2": w2, "y": y.detach(), "gathered": dense_gathered.detach(),
                    "grad_w1": full_grad_w1, "grad_x": x.grad}, out / "tp.pt")


def worker(out: str) -> None:
    out = Path(out)
    for moe in (False, True):
        train(out, "ddp", moe)
        train(out, "fsdp", moe)
    tensor_parallel(out)


if __name__ == "__main__":
    spawn_parallel_fn(worker, 2, sys.argv[1], backend="gloo")  # master_port 0: a free one

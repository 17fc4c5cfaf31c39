"""DDP and FSDP2 on 2 CPU processes match one process with the doubled batch; TP linears match dense."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "trainer"))
from trainer_helpers import MOE, TokenWindows, config, tiny_model  # noqa: E402

from astrai.trainer import Trainer  # noqa: E402


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(HERE / "parallel_worker.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"written: {sorted(p.name for p in out.iterdir())}\n{proc.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """One process with the doubled batch, dense and MoE: {moe: (weights, loss)}."""
    results = {}
    for moe in (False, True):
        tmp = tmp_path_factory.mktemp("single")
        cfg = config(tmp, batch_per_device=4, max_steps=3, save_final_model=False)
        model = tiny_model(**MOE) if moe else tiny_model()
        context = Trainer(cfg, model=model, train_dataset=TokenWindows(n=32)).train()
        results[moe] = {k: v.detach().clone() for k, v in context.model.state_dict().items()}, context.loss
    return results


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_data_parallel_matches_doubled_batch(distributed_results, single_process, mode, moe):
    name = f"{mode}_moe" if moe else mode
    result = torch.load(distributed_results / f"{name}.pt", weights_only=True)
    weights, loss = single_process[moe]
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    for key, tensor in weights.items():
        torch.testing.assert_close(result["weights"][key], tensor, rtol=1e-4, atol=1e-5, msg=key)
    assert (distributed_results / name / "ckpt" / "step_00000003" / "meta.json").is_file()


def test_tensor_parallel_linears_match_dense(distributed_results):
    r = torch.load(distributed_results / "tp.pt", weights_only=True)
    w1 = r["w1"].clone().requires_grad_(True)
    x = r["x"].clone().requires_grad_(True)
    dense = torch.nn.functional.gelu(x @ w1.T) @ r["w2"].T
    dense.square().sum().backward()
    torch.testing.assert_close(r["y"], dense.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r["gathered"], r["x"] @ r["w1"].T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r["grad_w1"], w1.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r["grad_x"], x.grad, rtol=1e-4, atol=1e-4)

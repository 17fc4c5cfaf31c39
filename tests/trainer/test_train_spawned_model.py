"""A model object handed to ``Trainer(..., nprocs=2)`` trains as one model on every rank.

Spawned processes receive its tensors in shared memory; each rank must update a copy of its own,
or every optimizer step lands on the same weights once per rank."""

import json

from trainer_helpers import TokenWindows, WeightSums, config, tiny_model

from astrai.trainer import Trainer


def test_ranks_keep_identical_weights_when_the_model_is_given(tmp_path):
    out = tmp_path / "sums"
    out.mkdir()
    cfg = config(tmp_path, nprocs=2, max_steps=3, save_final_model=False, master_port=0, device="cpu")  # 2 gloo ranks
    Trainer(cfg, callbacks=[WeightSums(out)], model=tiny_model(), train_dataset=TokenWindows(n=16)).train()
    for step in (1, 2, 3):
        rank0, rank1 = (json.loads((out / f"r{r}_s{step}.json").read_text()) for r in (0, 1))
        assert rank0 == rank1, step

"""The trainer opts into the CPU's faster fp32 matmuls for its run only: during training the
model's plain linears run as OneDnnLinear (where oneDNN pays here), and afterwards the model is
given back with its own classes and the same parameters (the CPU backend's: these runs train on the
CPU even where a GPU is visible). The decision is the run's: every rank
takes rank 0's, and a resumed run keeps the one its checkpoint records."""

import json

from trainer_helpers import MatmulsByRank, TokenWindows, config, tiny_model

from astrai.backends.cpu import training
from astrai.backends.cpu.training import OneDnnLinear
from astrai.model.components.layers import Linear
from astrai.serialization import Checkpoint
from astrai.trainer import TrainCallback, Trainer


class ClassesSeen(TrainCallback):
    def __init__(self):
        self.heads = []

    def on_batch_begin(self, context):
        self.heads.append(type(context.model.lm_head))


def test_the_run_swaps_in_fast_matmuls_and_gives_the_model_back(tmp_path, monkeypatch):
    monkeypatch.setattr(training, "onednn_fp32_pays", lambda: True)
    model = tiny_model()
    params = dict(model.named_parameters())
    seen = ClassesSeen()
    run = config(tmp_path, save_final_model=False, device="cpu")
    Trainer(run, callbacks=[seen], model=model, train_dataset=TokenWindows(n=4)).train()
    assert seen.heads and set(seen.heads) == {OneDnnLinear}
    assert type(model.lm_head) is Linear and all(type(m) is not OneDnnLinear for m in model.modules())
    assert dict(model.named_parameters()) == params


def _measures(monkeypatch, pays: bool) -> None:
    """This process's measurement says ``pays`` for both layouts."""
    monkeypatch.setattr(training, "_forward_layout_pays", lambda: pays)
    monkeypatch.setattr(training, "_weight_grad_layout_pays", lambda: pays)


RUN = dict(save_final_model=False, ckpt_interval=1, device="cpu")


def _first_step_saved(tmp_path, monkeypatch):
    """The checkpoint of a one-step run whose measurement chose oneDNN for both layouts."""
    monkeypatch.delenv("ASTRAI_ONEDNN_LINEAR", raising=False)
    _measures(monkeypatch, True)
    Trainer(config(tmp_path, max_steps=1, **RUN), model=tiny_model(), train_dataset=TokenWindows(n=8)).train()
    return tmp_path / "ckpt" / "step_00000001"


def _resumed_heads(tmp_path, first) -> list:
    """The head's class at every batch of a run resumed from ``first`` for one more step."""
    seen = ClassesSeen()
    Trainer(config(tmp_path, max_steps=2, **RUN), callbacks=[seen], model=tiny_model(),
            train_dataset=TokenWindows(n=8)).train(str(first))
    return seen.heads


def test_a_resumed_run_keeps_the_decision_its_checkpoint_records(tmp_path, monkeypatch):
    first = _first_step_saved(tmp_path, monkeypatch)
    assert Checkpoint.read_meta(first)["meta"]["backend_state"] == {"forward": True, "weight_grad": True}

    _measures(monkeypatch, False)  # the resuming process would choose MKL on its own
    heads = _resumed_heads(tmp_path, first)
    assert heads and set(heads) == {OneDnnLinear}
    second = Checkpoint.read_meta(tmp_path / "ckpt" / "step_00000002")["meta"]
    assert second["backend_state"] == {"forward": True, "weight_grad": True}

    monkeypatch.setenv("ASTRAI_ONEDNN_LINEAR", "0")  # the environment still decides
    heads = _resumed_heads(tmp_path, first)
    assert heads and set(heads) == {Linear}


def test_ranks_whose_measurements_disagree_take_rank_zeros_decision(tmp_path, monkeypatch):
    monkeypatch.delenv("ASTRAI_ONEDNN_LINEAR", raising=False)
    out = tmp_path / "heads"
    out.mkdir()
    cfg = config(tmp_path, nprocs=2, max_steps=1, save_final_model=False, master_port=0, ckpt_interval=1, device="cpu")
    Trainer(cfg, callbacks=[MatmulsByRank(out)], model=tiny_model(), train_dataset=TokenWindows(n=8)).train()
    assert [json.loads((out / f"r{rank}.json").read_text()) for rank in (0, 1)] == [["OneDnnLinear"]] * 2
    meta = Checkpoint.read_meta(tmp_path / "ckpt" / "step_00000001")["meta"]
    assert meta["backend_state"] == {"forward": True, "weight_grad": True}


def test_a_checkpoint_that_records_the_decision_as_cpu_products_resumes_with_it(tmp_path, monkeypatch):
    """Checkpoints written before the backend registry name the decision ``cpu_products``."""
    first = _first_step_saved(tmp_path, monkeypatch)
    written = json.loads((first / "meta.json").read_text())
    written["meta"]["cpu_products"] = written["meta"].pop("backend_state")
    (first / "meta.json").write_text(json.dumps(written))

    _measures(monkeypatch, False)  # the resuming process would choose MKL on its own
    heads = _resumed_heads(tmp_path, first)
    assert heads and set(heads) == {OneDnnLinear}
    second = Checkpoint.read_meta(tmp_path / "ckpt" / "step_00000002")["meta"]
    assert second["backend_state"] == {"forward": True, "weight_grad": True} and "cpu_products" not in second

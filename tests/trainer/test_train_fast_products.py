"""The trainer opts into the CPU's faster fp32 products for its run only: during training the
model's plain linears run as OneDnnLinear (where oneDNN pays here), and afterwards the model is
given back with its own classes and the same parameters."""

from trainer_helpers import TokenWindows, config, tiny_model

from astrai.backends.cpu import training
from astrai.backends.cpu.training import OneDnnLinear
from astrai.model.components.layers import Linear
from astrai.trainer import TrainCallback, Trainer


class ClassesSeen(TrainCallback):
    def __init__(self):
        self.heads = []

    def on_batch_begin(self, context):
        self.heads.append(type(context.model.lm_head))


def test_the_run_swaps_in_fast_products_and_gives_the_model_back(tmp_path, monkeypatch):
    monkeypatch.setattr(training, "onednn_fp32_pays", lambda: True)
    model = tiny_model()
    params = dict(model.named_parameters())
    seen = ClassesSeen()
    run = config(tmp_path, save_final_model=False)
    Trainer(run, callbacks=[seen], model=model, train_dataset=TokenWindows(n=4)).train()
    assert seen.heads and set(seen.heads) == {OneDnnLinear}
    assert type(model.lm_head) is Linear and all(type(m) is not OneDnnLinear for m in model.modules())
    assert dict(model.named_parameters()) == params

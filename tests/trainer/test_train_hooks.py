"""The loop fires the spec's hooks in order, every epoch (the last one included) ended before the run."""

from trainer_helpers import TokenWindows, config, tiny_model

from astrai.trainer import TrainCallback, Trainer

HOOKS = ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_batch_begin", "on_batch_end", "on_optimizer_step",
         "on_step_end", "on_epoch_end", "on_train_end")


class Recorder(TrainCallback):
    def __init__(self):
        self.calls = []

    def __getattribute__(self, name):
        if name in HOOKS:
            return lambda context: self.calls.append((name, context.epoch))
        return super().__getattribute__(name)


def test_hook_sequence_with_two_epochs_and_accumulation(tmp_path):
    recorder = Recorder()
    run = config(tmp_path, n_epoch=2, grad_accum_steps=2, save_final_model=False)
    Trainer(run, callbacks=[recorder], model=tiny_model(), train_dataset=TokenWindows(n=8)).train()
    step = ["on_step_begin", "on_batch_begin", "on_batch_end", "on_batch_begin", "on_batch_end",
            "on_optimizer_step", "on_step_end"]
    epoch = ["on_epoch_begin", *step, *step, "on_epoch_end"]  # 8 samples / batch 2 / accumulation 2
    assert [name for name, _ in recorder.calls] == ["on_train_begin", *epoch, *epoch, "on_train_end"]
    ends = [epoch_counter for name, epoch_counter in recorder.calls if name == "on_epoch_end"]
    assert ends == [1, 2]  # each epoch's end sees the epoch counted

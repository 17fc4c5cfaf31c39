"""cleanup_parallel leaves the group, then idles so gloo's threads finish before the interpreter exits.

Why the idling matters (a rank aborting after its work was done) is in cleanup_parallel's
docstring; the two-process runs in this folder are where it used to show.
"""

import torch.distributed as dist

from astrai.parallel import cleanup_parallel, is_distributed
from astrai.parallel import setup as parallel_setup


def test_cleanup_destroys_the_group_then_settles(tmp_path, monkeypatch):
    events = []
    destroy = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (events.append("destroy"), destroy()))
    monkeypatch.setattr(parallel_setup.time, "sleep", lambda seconds: events.append(("sleep", seconds)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dist.all_reduce(parallel_setup.torch.ones(4))  # a finished collective for the workers to release
        cleanup_parallel()
    finally:
        if is_distributed():
            destroy()
    assert not is_distributed()
    assert events == ["destroy", ("sleep", parallel_setup.BACKEND_SETTLE_SECONDS)]
    assert parallel_setup.BACKEND_SETTLE_SECONDS >= 0.05


def test_cleanup_outside_a_group_does_nothing(monkeypatch):
    monkeypatch.setattr(parallel_setup.time, "sleep", lambda seconds: (_ for _ in ()).throw(AssertionError("slept")))
    cleanup_parallel()
    assert not is_distributed()

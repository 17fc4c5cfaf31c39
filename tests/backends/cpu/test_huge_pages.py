"""The CPU runner's weights live in memory advised for 2 MiB pages (faster streaming when decoding)."""

from __future__ import annotations

import gc

import pytest
import torch

from astrai.inference import InferenceEngine, SamplingParams
from astrai.backends.cpu.huge_pages import HUGE_PAGE_BYTES, huge_page_empty, huge_pages_available
from inference_helpers import greedy_reference, make_model

pytestmark = pytest.mark.skipif(not huge_pages_available(), reason="transparent huge pages need Linux with THP not 'never'")


def _vm_flags(address: int) -> set[str]:
    """The kernel's flags for the mapping holding ``address`` ('hg': advised for huge pages)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_buffer_is_advised_aligned_and_outlives_its_first_owner():
    buffer = huge_page_empty((1024, 1024))
    assert buffer.shape == (1024, 1024) and buffer.dtype == torch.float32 and buffer.is_contiguous()
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in _vm_flags(buffer.data_ptr())
    values = torch.randn(1024, 1024)
    buffer.copy_(values)
    view = buffer.t()
    del buffer
    gc.collect()
    assert torch.equal(view.t(), values)  # the mapping lives as long as any view of it


def test_only_whole_huge_pages_are_advised():
    # 3 MiB: one whole huge page and a partial one, which as a huge page would be 1 MiB of waste
    buffer = huge_page_empty(((3 << 20) // 4,))
    buffer.fill_(1.0)
    assert "hg" in _vm_flags(buffer.data_ptr()) and "hg" in _vm_flags(buffer.data_ptr() + HUGE_PAGE_BYTES - 4)
    assert "hg" not in _vm_flags(buffer.data_ptr() + HUGE_PAGE_BYTES)


def test_small_buffers_and_the_switch_give_plain_memory(monkeypatch):
    small = huge_page_empty((16, 16))
    assert "hg" not in _vm_flags(small.data_ptr())
    monkeypatch.setenv("ASTRAI_HUGE_PAGES", "0")
    assert not huge_pages_available()
    large = huge_page_empty((1024, 1024))
    assert large.shape == (1024, 1024) and "hg" not in _vm_flags(large.data_ptr())


def test_a_refused_mapping_or_advice_falls_back_to_plain_memory(monkeypatch):
    import mmap

    from astrai.backends.cpu import huge_pages

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    large = huge_page_empty((1024, 1024))
    assert large.shape == (1024, 1024) and "hg" not in _vm_flags(large.data_ptr())
    monkeypatch.undo()

    class NoAdvice(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(huge_pages.mmap, "mmap", NoAdvice)
    large = huge_page_empty((1024, 1024))
    assert large.shape == (1024, 1024) and "hg" not in _vm_flags(large.data_ptr())


def test_the_engine_lays_large_weights_into_huge_pages_and_decodes_the_same():
    # the tied table (2048 x 256 floats) and each joint gate/up buffer (256 x 2048) are 2 MiB
    model = make_model("tiny", vocab_size=2048, dim=256, dim_ffn=1024)
    prompt = [5, 17, 3, 99, 42]
    expected = greedy_reference(model, prompt, 6)
    table = model.embed_tokens.weight
    assert "hg" not in _vm_flags(table.data_ptr())
    with InferenceEngine(model, None, max_batch_size=2, num_pages=16, page_size=4) as engine:
        assert "hg" not in _vm_flags(table.data_ptr())  # the caller's model stays as it was
        model = engine.model
        table = model.embed_tokens.weight
        assert model.lm_head.weight is table
        assert "hg" in _vm_flags(table.data_ptr())
        gate_up = model.layers[0].mlp.gate.weight
        assert gate_up.numel() * 8 >= HUGE_PAGE_BYTES and "hg" in _vm_flags(gate_up.data_ptr())
        out = engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)).result()
    assert out.token_ids == expected


def test_a_quantized_models_lone_weights_are_laid_into_huge_pages_too():
    """The head and the linears outside a stacked group (o_proj, down) stream as much as the
    groups do: their blocks move into huge pages too, and decoding gives the same tokens."""
    from astrai.model.quantized import quantize_model

    model = quantize_model(make_model("tiny", vocab_size=4096, dim=512, dim_ffn=4096, n_layers=1), "int8")
    prompt = [5, 17, 3, 99, 42]
    expected = greedy_reference(model, prompt, 6)
    with InferenceEngine(model, None, max_batch_size=2, num_pages=16, page_size=4) as engine:
        served = engine.model
        for module in (served.lm_head, served.layers[0].mlp.down):  # 4096 x 512 and 512 x 4096 int8: 2 MiB
            assert module.qweight.nbytes >= HUGE_PAGE_BYTES and "hg" in _vm_flags(module.qweight.data_ptr())
        out = engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)).result()
    assert out.token_ids == expected

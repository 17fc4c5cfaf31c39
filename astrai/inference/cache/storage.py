"""Storage: one flat tensor per cached quantity, addressed by token slot.

Each layer's two per-token tensors (K/V for GQA; latent and rotary key for MLA, as
``model.cache_shapes()`` says) live in ``[n_layers, slots, heads, width]`` tensors,
where slot = page * page_size + offset. Keeping the store flat makes a write one
``index_copy_`` and a gather one ``index_select`` per layer, whatever the page
layout. One extra "sink" page at the end absorbs writes of padding tokens and is
what padded gather positions read; it is never handed out by the allocator.

The store's dtype may be narrower than the model's (``kv_cache_dtype``): a 16-bit cache
halves the bytes a decode step reads from a long context. Values are rounded as they are
written and widened where attention reads them.
"""

from __future__ import annotations

from typing import Optional

import torch

from astrai.errors import RequestError

KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_dtype(value: Optional[str | torch.dtype]) -> Optional[torch.dtype]:
    """The torch dtype a ``kv_cache_dtype`` setting names (None: the model's own), or a
    RequestError listing the accepted names."""
    if value is None or (isinstance(value, torch.dtype) and value in KV_CACHE_DTYPES.values()):
        return value
    if isinstance(value, str) and value in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[value]
    raise RequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (or unset: the model's dtype), "
                       f"got {value!r}")


class Storage:
    def __init__(self, n_layers: int, num_pages: int, page_size: int,
                 cache_shapes: tuple[tuple[int, int], tuple[int, int]],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.n_layers, self.num_pages, self.page_size = n_layers, num_pages, page_size
        (self.k_heads, self.k_width), (self.v_heads, self.v_width) = cache_shapes
        slots = (num_pages + 1) * page_size
        self.k_cache = torch.zeros(n_layers, slots, self.k_heads, self.k_width, dtype=dtype, device=device)
        self.v_cache = torch.zeros(n_layers, slots, self.v_heads, self.v_width, dtype=dtype, device=device)
        self.sink_page = num_pages

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    def bytes_per_token(self) -> int:
        per_layer = self.k_heads * self.k_width + self.v_heads * self.v_width
        return per_layer * self.n_layers * self.k_cache.element_size()

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens ``k``/``v`` [B, T, heads, width] at flat ``slots`` [B*T]."""
        self.k_cache[layer_id].index_copy_(0, slots, k.reshape(-1, self.k_heads, self.k_width).to(self.k_cache.dtype))
        self.v_cache[layer_id].index_copy_(0, slots, v.reshape(-1, self.v_heads, self.v_width).to(self.v_cache.dtype))

    def gather(self, layer_id: int, slots: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read ``slots`` [B*S] back as ([B, S, k_heads, k_width], [B, S, v_heads, v_width])."""
        k = self.k_cache[layer_id].index_select(0, slots).view(batch, -1, self.k_heads, self.k_width)
        v = self.v_cache[layer_id].index_select(0, slots).view(batch, -1, self.v_heads, self.v_width)
        return k, v

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V at slots ``src`` to slots ``dst`` (a task taking tokens another
        task computed in a page that is not full, so not shared)."""
        for cache in (self.k_cache, self.v_cache):
            cache.index_copy_(1, dst, cache.index_select(1, src))

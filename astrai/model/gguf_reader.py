"""llama.cpp's GGUF reader, checking that the file holds every tensor it lists before mapping them.

A file cut short (an interrupted download, a full disk) still parses its metadata and tensor
list, and the plain reader then fails inside numpy ("cannot reshape array of size ...").
Here the tensor list is checked against the file's size first, so the error names the
first tensor that lies past the end and how many bytes are missing.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from astrai.errors import CheckpointError


class CheckedGGUFReader(GGUFReader):
    def __init__(self, path: str, mode: str = "r"):
        self.path = path
        super().__init__(path, mode)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            end = int(start_offs) + int(offset[0]) + int(np.prod(dims, dtype=np.int64)) * block_bytes // block
            if end > size:
                raise CheckpointError(f"{self.path}: the GGUF file is truncated (tensor "
                                      f"'{bytes(name).decode('utf-8', 'replace')}' ends at byte {end}, past the "
                                      f"file's end (byte {size}): {end - size} bytes are missing); download or "
                                      "convert it again")
        super()._build_tensors(start_offs, fields)

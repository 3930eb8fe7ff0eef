"""Opening a GGUF file (llama.cpp's format) for its metadata and tensors: the one reader the
tokenizer and the weight loader share.

gguf's GGUFReader parses the header through a numpy.memmap, and every slice of a memmap runs
memmap's Python-level __getitem__ and __array_finalize__: a vocabulary of 49k tokens and as many
merges is ~700k slices, seconds per open (the tokenizer and the loader each open the file).
`GGUFFile` hands the parser a plain ndarray view of the same mapping instead: no copy, tensors
still memory-mapped, the same fields about three times faster."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader


class GGUFFile(GGUFReader):
    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # GGUFReader.__init__ assigns its memmap here
        self._mapped = mapped.view(np.ndarray)

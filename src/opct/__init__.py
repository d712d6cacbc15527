"""opct: On-Policy Consistency Training of language models."""

import os

# PyTorch's CPU allocator asks for transparent huge pages (madvise) on tensors of 2 MB and more when this is set.
# A training step allocates and frees gigabytes of activations, and every fresh 4 kB page is a page fault: on the
# 2-core VMs we measure on, a fresh 50 MB tensor costs ~12 ms to touch with 4 kB pages and ~4 ms with huge pages,
# and a SmolLM2 OPCT step was ~6% faster in 3 of 4 interleaved A/B runs (the 4th slower; this VM is noisy).
# PyTorch reads it lazily, so setting it here works even after `import torch`, unless a large tensor was already
# allocated. THP_MEM_ALLOC_ENABLE=0 in the environment turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"

"""Repo-wide pytest setup: without CUDA, Triton kernels run in the CPU interpreter.

Set here, before any test module imports triton, so every package's Triton tests agree.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

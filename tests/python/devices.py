"""The devices a twin test runs on: the CPU, and CUDA where this build has it and a GPU is present
(the CUDA case is in the gpu tier, conftest.py)."""

import torch

import dpzero

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dpzero._C.with_cuda else [])

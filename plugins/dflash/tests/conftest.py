"""Fixtures of the dflash plugin's tests."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Run each test on one intra-op thread: the models here are tiny, and on a shared machine
    several threads per process spin against each other (a 10 µs op then takes milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

"""Fixtures of the eagle3 plugin's tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def single_torch_thread():
    """Run these tiny-tensor tests on one intra-op thread, restoring the setting afterwards.

    Their matrices are a few dozen wide: a second thread brings no speed, and on a busy
    machine the thread pool's synchronisation makes each small op milliseconds slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

"""The soak's process sample waits out a descriptor that is being closed, and still counts one that stays."""
import os
import threading

import pytest

from tools.soak import process_sample, settled_sample

pytestmark = pytest.mark.cpu


def test_a_sample_waits_for_a_descriptor_that_is_being_closed():
    before = process_sample(os.getpid())
    read, write = os.pipe()
    closer = threading.Timer(0.1, lambda: (os.close(read), os.close(write)))
    closer.start()
    sample = settled_sample(os.getpid(), interval_s=0.2)  # first read: 2 descriptors and a thread more
    closer.join()
    assert (sample.fds, sample.threads) == (before.fds, before.threads)


def test_a_descriptor_that_stays_is_counted():
    before = process_sample(os.getpid())
    read, write = os.pipe()
    try:
        assert settled_sample(os.getpid(), interval_s=0.05).fds == before.fds + 2
    finally:
        os.close(read)
        os.close(write)

"""The process-wide switches: gpattn.deterministic() and gpattn.validation() opened in one
thread hold in every thread (nn.DataParallel replicas run the layers in worker threads)."""

import threading

import pytest
import torch

import gpattn


def _in_thread(fn):
    box = {}

    def work():
        box["value"] = fn()

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    return box["value"]


def test_deterministic_block_holds_in_a_worker_thread():
    torch.manual_seed(0)
    layer = gpattn.build_attention("sgpa", 8, 2).eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), gpattn.deterministic():
        mean = layer(x)
        in_thread = _in_thread(lambda: (gpattn.is_deterministic(), layer(x)))
    assert in_thread[0] is True
    torch.testing.assert_close(in_thread[1], mean, rtol=0, atol=0)  # the posterior mean, not a sample
    with torch.no_grad():
        sampled = _in_thread(lambda: layer(x))
    assert not torch.allclose(sampled, mean)
    assert not gpattn.is_deterministic()


def test_blocks_closed_out_of_order_across_threads():
    outer, inner = gpattn.deterministic(), gpattn.deterministic(False)
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # another thread closed its block first: the other stays open
    assert gpattn.is_deterministic() is False
    inner.__exit__(None, None, None)
    assert gpattn.is_deterministic() is False


def test_validation_switch():
    assert gpattn.is_validating() is False  # default: no value check that synchronises
    with gpattn.validation():
        assert _in_thread(gpattn.is_validating) is True
        with gpattn.validation(False):
            assert gpattn.is_validating() is False
    gpattn.set_validation(True)
    try:
        assert gpattn.is_validating() is True
    finally:
        gpattn.set_validation(False)
    with pytest.raises(ValueError, match="validation"):
        gpattn.validation("yes")
    with pytest.raises(ValueError, match="deterministic"):
        gpattn.deterministic(1)

"""The kvstore views of ``training.loop.kvstore_sync`` on an in-process ``local`` store: keys shift,
views compose, and the base store lives exactly as long as its last view (its destructor is a
dist worker's exit barrier, so it must not wait for a garbage collection)."""
import gc
import weakref

import pytest

from common.mx import import_mxnet
from training.loop.kvstore_sync import with_key_offset

pytestmark = pytest.mark.unit


def test_key_offset_views_compose_and_shift_every_key():
    mx = import_mxnet()
    kv = mx.kv.create("local")
    outer = with_key_offset(with_key_offset(kv, 100), 20)
    outer.init(3, mx.nd.ones((2,)) * 7)
    got = mx.nd.zeros((2,))
    kv.pull(123, out=got)
    assert got.asnumpy().tolist() == [7.0, 7.0]
    outer.init([4, 5], [mx.nd.ones((1,)), mx.nd.ones((1,)) * 2])
    pulled = [mx.nd.zeros((1,)), mx.nd.zeros((1,))]
    kv.pull([124, 125], out=pulled)
    assert [p.asscalar() for p in pulled] == [1.0, 2.0]


def test_the_base_store_goes_with_its_last_view_without_a_collection():
    mx = import_mxnet()
    gc.collect()
    gc.disable()
    try:
        kv = mx.kv.create("local")
        alive = weakref.ref(kv)
        view = with_key_offset(with_key_offset(kv, 5), 7)
        del kv
        assert alive() is not None  # the views keep it
        del view
        assert alive() is None  # and nothing else does, with the collector off
    finally:
        gc.enable()

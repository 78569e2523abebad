"""coordl.compat: each private PyTorch or DALI internal coordl uses, checked against the installed
libraries, so that an upgrade that removes or changes one fails here, by name."""

from __future__ import annotations

import collections
import multiprocessing

import numpy as np
import pytest
import torch
from nvidia.dali import fn, pipeline_def, types

from coordl import compat
from coordl.prep.planned import uses_dali_random


class _Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i * i


def _alive(it) -> list[bool]:
    return [w.is_alive() for w in it._workers]


def test_an_iterators_workers_are_stopped_now():
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    assert any(_alive(it))
    compat.shutdown_iterator_workers(it)
    assert not any(_alive(it))
    compat.shutdown_iterator_workers(iter(torch.utils.data.DataLoader(_Squares())))  # no workers: nothing to do


def test_a_dataloaders_persistent_workers_are_stopped():
    loader = torch.utils.data.DataLoader(_Squares(), batch_size=2, num_workers=2, persistent_workers=True)
    assert [b.tolist() for b in loader] == [[0, 1], [4, 9], [16, 25], [36, 49]]
    it = loader._iterator  # what compat relies on: the iterator kept for the next epoch
    assert it is not None and any(_alive(it))
    compat.shutdown_dataloader_workers(loader)
    assert not any(_alive(it))
    with pytest.raises(compat.CompatError, match=r"torch .* has no DataLoader._iterator"):
        compat.shutdown_dataloader_workers(object())


def test_pin_memory_walks_a_batch_as_the_dataloaders_thread_does():
    Pair = collections.namedtuple("Pair", "a b")
    batch = {"labels": [1, 2], "pair": Pair("x", 3)}
    assert compat.pin_memory(batch) == batch  # no tensors: given back alike, structure and types kept
    if torch.cuda.is_available():
        pinned = compat.pin_memory({"x": torch.zeros(2)})
        assert pinned["x"].is_pinned()


@pipeline_def(batch_size=1, num_threads=1, device_id=None)
def _graph():
    x = fn.external_source(name="x", dtype=types.UINT8, ndim=1)
    return fn.decoders.image(x, device="cpu"), fn.random.coin_flip()


def test_a_pipelines_operators_are_listed():
    pipe = _graph()
    pipe.build()
    names = compat.pipeline_schemas(pipe)
    assert "decoders__Image" in names and "random__CoinFlip" in names
    assert uses_dali_random(names) == ["random.CoinFlip"]
    with pytest.raises(compat.CompatError, match=r"nvidia-dali .* has no Pipeline._ops"):
        compat.pipeline_schemas(object())


def _abandon_in_child(pipe, q):
    compat.abandon_pipeline(pipe)
    q.put(pipe._pipe is None)  # then the child exits normally: the handle is never shut down here


def test_a_forked_child_lets_go_of_its_parents_pipeline():
    pipe = _graph()
    pipe.build()
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_abandon_in_child, args=(pipe, q))
    child.start()
    assert q.get(timeout=60) is True
    child.join(60)
    assert child.exitcode == 0  # shutting the parent's pipeline down in the child would abort it
    pipe.feed_input("x", [np.frombuffer(_jpeg(), np.uint8)])
    images, _ = pipe.run()  # the parent's pipeline is untouched
    assert np.asarray(images.as_tensor()).shape[-1] == 3


def _jpeg() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 128, np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()

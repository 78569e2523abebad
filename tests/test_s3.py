"""s3:// datasets against a real S3-compatible server on localhost: moto's server behind a proxy
that counts every request and injects latency, failures and hangs (``coordl_testing.s3server``).

Nothing here mocks a client: coordl lists with boto3 and reads with obstore over real sockets,
and the counts are the server's view (the proxy's), compared with coordl's own accounting.
Tests that change the process-wide settings (timeouts, retries, credentials) run a script in a
subprocess, as a user's job would.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("moto")
pytest.importorskip("obstore")
pytest.importorskip("boto3")

import coordl
import s3_exits
from coordl import CoordLoader, ImageNetTrain
from coordl.errors import DatasetChangedError, SampleError, StoreError
from coordl.fetch.fetcher import Fetcher
from coordl.index import Index
from coordl.s3 import client, reads
from coordl.threads import LOOP_THREAD, Signal
from coordl_testing.s3server import S3Server
from recording import take

HERE = Path(__file__).resolve().parent
N = 120  # samples in tiny_dataset
BUCKET = "coordl-data"
RECIPE = ImageNetTrain(size=16)


@pytest.fixture(scope="module")
def server(s3_server):
    s3_server.create_bucket(BUCKET)
    return s3_server


@pytest.fixture
def s3env(server, monkeypatch):
    """This process talks to the module's server (the settings a process resolves once)."""
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    server.reset()
    return server


@pytest.fixture
def root(s3env, s3_tree, tiny_dataset) -> str:
    """A fresh prefix holding the tiny dataset: ``s3://coordl-data/p<k>/train``."""
    return s3_tree(BUCKET, tiny_dataset)


GUARD_S = 60.0  # a guard against waiting forever for a request that never comes: not a bound of coordl's


class Arrivals:
    """The proxy's requests as they are recorded, with when, and a way to wait for them. The proxy runs in
    this process and records a stalled request (:meth:`S3Server.hang`) as it arrives, with status 0, any
    other once it is answered; scripts in other processes go through it too."""

    def __init__(self, server: S3Server, monkeypatch):
        self.server = server
        self.seen: list[tuple[float, str, str, int]] = []  # (time.monotonic(), method, path, status)
        self._cond = threading.Condition()
        record = server._record

        def recorded(method: str, path: str, status: int, nbytes: int) -> None:
            record(method, path, status, nbytes)
            with self._cond:
                self.seen.append((time.monotonic(), method, path, status))
                self._cond.notify_all()

        monkeypatch.setattr(server, "_record", recorded)

    def wait(self, until, what: str) -> None:
        """Returns once ``until(gets)`` holds, ``gets`` the proxy's GETs so far (:meth:`S3Server.requests`)."""
        with self._cond:
            done = self._cond.wait_for(lambda: until(self.server.requests("GET")), GUARD_S)
        assert done, f"waited {GUARD_S:g} s (a guard) for {what}; the proxy saw {self.server.requests('GET')}"

    def times(self, path: str) -> list[float]:
        """When the proxy recorded each GET of ``path``."""
        with self._cond:
            return [t for t, method, p, _ in self.seen if method == "GET" and p == path]


@pytest.fixture
def arrivals(s3env, monkeypatch) -> Arrivals:
    return Arrivals(s3env, monkeypatch)


def _stalled(gets) -> int:
    return sum(status == 0 for *_, status, _ in gets)


def _key(url: str) -> str:
    return url.split(f"s3://{BUCKET}/", 1)[1]


def _relative(paths, base: str) -> list[str]:
    return [p.split(base, 1)[1] for p in paths]


def _script(code: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``code`` as a user's script, in a fresh process with ``env`` added."""
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), full.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# -- listing and the index ---------------------------------------------------------------------


def test_listing_follows_imagefolder_rules_over_keys(s3env, tiny_dataset, tmp_path):
    local = tmp_path / "train"
    shutil.copytree(tiny_dataset, local)
    (local / "class_02" / "sub").mkdir()
    (local / "class_02" / "sub" / "deeper.jpg").write_bytes((local / "class_02" / "img_0000.jpg").read_bytes())
    (local / "class_01" / "notes.txt").write_text("not an image")
    (local / "class_03" / "UPPER.JPG").write_bytes(b"\xff\xd8 tiny")
    (local / "stray.jpg").write_bytes(b"outside every class")
    s3env.upload_tree(local, BUCKET, "rules/train")
    s3env.put(BUCKET, "rules/train/class_00/", b"")  # a "folder" marker some tools write
    s3env.reset()

    remote = Index.scan(f"s3://{BUCKET}/rules/train/")  # a trailing slash names the same root
    expected = Index.scan(local, index_dir="")
    assert remote.root == f"s3://{BUCKET}/rules/train"
    assert remote.classes == expected.classes
    assert _relative(remote.paths, "/rules/train/") == _relative(expected.paths, str(local) + "/")
    assert remote.labels.tolist() == expected.labels.tolist()
    assert remote.sizes.tolist() == expected.sizes.tolist()
    md5s = [f'"{hashlib.md5(Path(p).read_bytes()).hexdigest()}"' for p in expected.paths]
    assert list(remote.etags) == md5s  # moto's ETag of a simple PUT is its MD5
    assert s3env.count("GET", objects_only=True) == 0  # listing only: no object was read
    assert remote.in_store and not expected.in_store


def test_a_restart_reuses_the_saved_index_after_one_listing_and_a_new_class_is_seen(root, s3env, tiny_dataset):
    first = Index.scan(root)
    listed = s3env.count("GET", objects_only=False)
    assert listed >= 5  # the classes, then each class
    s3env.reset()
    again = Index.scan(root)
    # One listing of the prefix (the class prefixes, then each class's keys: the sizes and ETags the
    # saved index is checked against, docs/object-stores.md), no object read, the saved index reused.
    assert s3env.count("GET", objects_only=False) == listed and s3env.count("GET") == 0
    assert again.fingerprint == first.fingerprint and again.saved_path == first.saved_path and again.changed == 0
    assert again.etags == first.etags and again.paths == first.paths

    s3env.put(BUCKET, _key(root) + "/class_99/new.jpg", (tiny_dataset / "class_00" / "img_0000.jpg").read_bytes())
    s3env.reset()
    grown = Index.scan(root)
    assert grown.classes[-1] == "class_99" and len(grown) == N + 1
    assert s3env.count("GET", objects_only=False) > 1  # listed again


def test_reindex_lists_again_and_sees_keys_added_to_a_class(root, s3env, tiny_dataset, monkeypatch):
    Index.scan(root)
    s3env.put(BUCKET, _key(root) + "/class_00/zzz.jpg", (tiny_dataset / "class_00" / "img_0000.jpg").read_bytes())
    assert len(Index.scan(root)) == N  # the saved index: a key added to a class is not seen
    monkeypatch.setenv("COORDL_REINDEX", "1")
    assert len(Index.scan(root)) == N + 1


def test_a_list_of_urls_gets_sizes_and_etags_from_the_store(root, s3env, tiny_dataset):
    scanned = Index.scan(root, index_dir="")
    pairs = [(scanned.paths[i], int(scanned.labels[i])) for i in range(0, N, 3)]
    s3env.reset()
    listed = Index.from_list(pairs)
    assert list(listed.paths) == [u for u, _ in pairs]
    assert listed.sizes.tolist() == scanned.sizes[::3].tolist()
    assert listed.etags == [scanned.etags[i] for i in range(0, N, 3)]
    assert s3env.count("GET", objects_only=False) == 4  # one listing per class folder, not a HEAD per URL
    few = Index.from_list([pairs[0], pairs[-1]])  # two URLs in two folders: a HEAD each
    assert few.sizes.tolist() == [listed.sizes[0], listed.sizes[-1]]
    assert s3env.count("HEAD") == 2
    with pytest.raises(FileNotFoundError, match=f"sample s3://{BUCKET}/.*/class_00/missing.jpg does not exist"):
        Index.from_list([*pairs, (root + "/class_00/missing.jpg", 0)])
    with pytest.raises(ValueError, match="mixes s3:// URLs and files"):
        Index.from_list([pairs[0], (str(tiny_dataset / "class_00" / "img_0000.jpg"), 0)])


def test_an_empty_prefix_or_a_missing_bucket_says_so(s3env):
    with pytest.raises(FileNotFoundError, match="no class folders found in s3://coordl-data/nothing-here"):
        Index.scan(f"s3://{BUCKET}/nothing-here")
    from coordl.errors import StoreError

    with pytest.raises(StoreError, match="does not exist at this endpoint"):
        Index.scan("s3://no-such-bucket-here/train")


# -- epochs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", [0, 0.5, 1.0], ids=["no-cache", "half", "all"])
def test_epochs_are_exactly_once_and_later_epochs_get_only_the_uncached_samples(root, s3env, cache):
    with CoordLoader(
        root,
        batch_size=16,
        pipeline=RECIPE,
        device_id=None,
        return_index=True,
        seed=3,
        cache=cache,
        prep=1,
        shuffle=True,
    ) as loader:
        for epoch in range(3):
            s3env.reset()
            seen = Counter(i for _, _, ids in loader for i in ids.tolist())
            assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}, f"epoch {epoch}"
            s = loader.stats()
            gets = s3env.count("GET")
            assert gets == s["storage_reads"]  # one GET per sample read, no more
            assert s3env.bytes_sent("GET") == s["storage_bytes"]
            if epoch == 0:
                assert gets == N
            else:
                assert gets == N - s["cache_items"] == N - s["cache_hits"]  # exactly the uncached samples
    if cache == 1.0:
        assert gets == 0


def test_an_s3_loader_delivers_the_local_loaders_tensors(root, tiny_dataset):
    got, want = {}, {}
    with CoordLoader(
        root, batch_size=8, pipeline=RECIPE, device_id=None, return_index=True, seed=7, cache=0.5, prep=1, shuffle=True
    ) as loader:
        for epoch in (0, 1):
            take(loader, got, epoch)
    with CoordLoader(
        str(tiny_dataset),
        batch_size=8,
        pipeline=RECIPE,
        device_id=None,
        return_index=True,
        seed=7,
        cache=0,
        prep=1,
        shuffle=True,
    ) as loader:
        for epoch in (0, 1):
            take(loader, want, epoch)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_resumed_s3_loader_continues_where_the_state_was_saved(root):
    def loader():
        return CoordLoader(
            root,
            batch_size=8,
            pipeline=RECIPE,
            device_id=None,
            return_index=True,
            seed=7,
            cache=0.5,
            prep=1,
            shuffle=True,
        )

    with loader() as a:
        whole = [ids.tolist() for _, _, ids in a]
    with loader() as a:
        for k, _ in enumerate(a):
            if k == 4:
                break
        state = a.state_dict()
    with loader() as b:
        b.load_state_dict(json.loads(json.dumps(state)))
        rest = [ids.tolist() for _, _, ids in b]
    assert rest == whole[5:]


# -- failures ----------------------------------------------------------------------------------


def test_throttling_and_server_errors_are_retried(root, s3env):
    s3env.fail(_key(root) + "/class_00/*", 503, times=6)
    s3env.fail(_key(root) + "/class_01/*", 500, times=4)
    with CoordLoader(
        root, batch_size=16, pipeline=RECIPE, device_id=None, return_index=True, cache=0, prep=1, shuffle=True
    ) as loader:
        seen = Counter(i for _, _, ids in loader for i in ids.tolist())
        s = loader.stats()
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    statuses = Counter(status for method, _, status, _ in s3env.requests("GET") if method == "GET")
    assert statuses[503] == 6 and statuses[500] == 4
    assert s3env.count("GET") == N + 10  # every sample once, and the ten refused tries again
    assert s["storage_reads"] == N  # the failed attempts are the client's retries, not samples


def test_a_missing_object_follows_on_error_with_its_url(root, s3env):
    index = Index.scan(root)  # checked at its start: the run's index
    gone = index.paths[17]
    s3env.delete(BUCKET, _key(gone))  # during the run (one gone before it is listed away: test_currency.py)
    with CoordLoader(index, batch_size=16, pipeline=RECIPE, device_id=None, cache=0, prep=1, shuffle=True) as loader:
        with pytest.raises(SampleError, match=f"cannot read sample 17 \\({gone}\\): no such object \\(404"):
            for _ in loader:
                pass
    with CoordLoader(
        index,
        batch_size=16,
        pipeline=RECIPE,
        device_id=None,
        on_error="skip",
        return_index=True,
        cache=0,
        prep=1,
        shuffle=True,
    ) as loader:
        seen = [i for _, _, ids in loader for i in ids.tolist()]
        assert sorted(seen) == [i for i in range(N) if i != 17]
        assert loader.stats()["skipped_paths"] == [gone]


def test_a_forbidden_object_follows_on_error(root, s3env):
    index = Index.scan(root)
    s3env.fail(_key(index.paths[5]), 403, times=100)
    with CoordLoader(
        root,
        batch_size=16,
        pipeline=RECIPE,
        device_id=None,
        on_error="skip",
        return_index=True,
        cache=0,
        prep=1,
        shuffle=True,
    ) as loader:
        seen = [i for _, _, ids in loader for i in ids.tolist()]
    assert sorted(seen) == [i for i in range(N) if i != 5]
    with CoordLoader(root, batch_size=16, pipeline=RECIPE, device_id=None, cache=0, prep=1, shuffle=True) as loader:
        with pytest.raises(SampleError, match="access denied \\(403 AccessDenied\\)"):
            for _ in loader:
                pass


@pytest.mark.parametrize("same_size", [True, False], ids=["same-size", "other-size"])
def test_a_changed_object_raises_dataset_changed_and_the_next_start_lists_again(root, s3env, same_size):
    index = Index.scan(root)  # checked at its start: the run's index
    victim = index.paths[40]
    old = s3env.client().get_object(Bucket=BUCKET, Key=_key(victim))["Body"].read()
    new = bytes(reversed(old)) if same_size else old + b"\0" * 10
    s3env.put(BUCKET, _key(victim), new)  # during the run (a change before it is read anew: test_currency.py)
    with CoordLoader(index, batch_size=16, pipeline=RECIPE, device_id=None, cache=0, prep=1, shuffle=True) as loader:
        with pytest.raises(DatasetChangedError, match=f"{victim} (changed after it was indexed|is {len(new)} bytes)"):
            for _ in loader:
                pass
    assert not os.path.exists(index.saved_path)  # forgotten: the restart the error asks for lists again
    relisted = Index.scan(root)
    assert relisted.etags[40] != index.etags[40] and relisted.fingerprint != index.fingerprint


def test_closing_a_loader_abandons_the_requests_that_still_wait_for_the_store(root, s3env, arrivals):
    index = Index.scan(root)
    for i in range(24, 48):  # batches 3-5: in flight ahead of DALI's queue when the loop leaves after batch 0
        s3env.hang(_key(index.paths[i]), 60.0, times=100)
    loader = CoordLoader(
        root,
        batch_size=8,
        shuffle=False,
        pipeline=RECIPE,
        device_id=None,
        cache=0,
        prep=1,
        fetch=coordl.Fetch(batches_ahead=2),
    )
    for _ in loader:
        break
    arrivals.wait(_stalled, "a request of batch 3 stalled at the store")
    t0 = time.monotonic()
    loader.close()
    took = time.monotonic() - t0
    assert took < 1.0, took  # "a loader closes in well under a second" (guarantees.md), not at the 30 s timeout


# -- the read path: one event loop, a stop signal, errors by type -------------------------------


def _read_args(index: Index, ids) -> tuple[list, list, list, list]:
    """``read_many``'s arguments for samples ``ids``: URLs, sizes, ETags, a buffer each."""
    ids = list(ids)
    sizes = [int(index.sizes[i]) for i in ids]
    return [index.paths[i] for i in ids], sizes, [index.etags[i] for i in ids], [[bytearray(n)] for n in sizes]


def _content(s3env, path: str) -> bytes:
    return s3env.client().get_object(Bucket=BUCKET, Key=_key(path))["Body"].read()


def test_reads_run_on_one_event_loop_thread_whatever_thread_calls(root, s3env):
    index = Index.scan(root)

    def read(ids) -> list[bytes]:
        urls, sizes, etags, buffers = _read_args(index, ids)
        assert reads.read_many(urls, sizes, etags, buffers) == {}
        return [bytes(b[0]) for b in buffers]

    first = read(range(8))
    loops = [t for t in threading.enumerate() if t.name == LOOP_THREAD]
    assert len(loops) == 1 and loops[0].daemon  # never joined at exit
    with cf.ThreadPoolExecutor(3) as pool:  # calls from several threads at once
        rest = [b for part in pool.map(read, [range(8, 40), range(40, 80), range(80, N)]) for b in part]

    async def caller_with_a_loop_of_its_own():
        return read(range(8))

    assert asyncio.run(caller_with_a_loop_of_its_own()) == first
    assert [t for t in threading.enumerate() if t.name == LOOP_THREAD] == loops  # the same thread, every call
    assert first + rest == [_content(s3env, p) for p in index.paths]
    assert s3env.count("GET") == N + 8


def test_a_call_whose_loader_has_closed_sends_nothing_to_the_store(root, s3env):
    index = Index.scan(root)
    s3env.reset()  # the listing's requests
    stop = Signal()
    stop.set()
    failed = reads.read_many(*_read_args(index, range(16)), stop=stop)
    assert sorted(failed) == list(range(16))
    assert {e.errno for e in failed.values()} == {errno.ECANCELED}
    # A request of that call would have left before this one, from the same client on the same event loop:
    # once this one has been answered, the store has seen everything the cancelled call sent.
    assert reads.read_many(*_read_args(index, [16])) == {}
    assert s3env.requests("GET") == [("GET", f"/{BUCKET}/{_key(index.paths[16])}", 200, int(index.sizes[16]))]


def test_closing_abandons_stuck_gets_at_once_without_polling(root, s3env, arrivals, monkeypatch):
    index = Index.scan(root)
    stuck = list(range(8, 16))
    for i in stuck:
        s3env.hang(_key(index.paths[i]), 60.0, times=1)
    fetcher = Fetcher(index, None, drop_page_cache=False)
    s3env.reset()
    # The reader has an object once its bytes are in the caller's buffer (reads._scatter): count those.
    landed, scatter = threading.Semaphore(0), reads._scatter
    monkeypatch.setattr(reads, "_scatter", lambda *a: (scatter(*a), landed.release()))
    out: dict = {}
    reader = threading.Thread(target=lambda: out.update(zip(("data", "errors"), fetcher.read(np.arange(16)))))
    reader.start()
    arrivals.wait(lambda gets: _stalled(gets) == len(stuck), "the stuck GETs at the store")
    for _ in range(16 - len(stuck)):  # the others answered, and their bytes arrived
        assert landed.acquire(timeout=GUARD_S), "an answered object did not reach its buffer (a guard)"
    t0 = time.monotonic()
    fetcher.closing.set()  # what Resources.close() does first
    reader.join(10)
    took = time.monotonic() - t0
    assert not reader.is_alive()
    assert took < 0.5, took  # a notification: not a poll, nor the 30 s timeout and its retries
    assert sorted(out["errors"]) == stuck
    assert all("the loader closed before the object arrived" in str(e) for e in out["errors"].values())
    assert [bytes(out["data"][i]) for i in range(8)] == [_content(s3env, index.paths[i]) for i in range(8)]


def test_the_stop_signal_is_a_notification_not_a_flag_that_is_polled(root, s3env, arrivals):
    """Setting the signal is what abandons the requests: even one set only for an instant (which a
    poll would most likely miss) does."""
    index = Index.scan(root)
    for i in range(4):
        s3env.hang(_key(index.paths[i]), 60.0, times=1)
    s3env.reset()
    stop = Signal()
    out: dict = {}
    caller = threading.Thread(
        target=lambda: out.update(failed=reads.read_many(*_read_args(index, range(4)), stop=stop))
    )
    caller.start()
    arrivals.wait(lambda gets: _stalled(gets) == 4, "the 4 GETs stalled at the store")
    stop.set()
    stop.clear()
    caller.join(5)
    assert not caller.is_alive()
    assert sorted(out["failed"]) == list(range(4)) and {e.errno for e in out["failed"].values()} == {errno.ECANCELED}


def test_a_failing_object_is_tried_attempts_times_then_fails_alone(root, s3env):
    index = Index.scan(root)
    bad = index.paths[3]
    s3env.fail(_key(bad), 500, times=100)
    attempts = client.settings().attempts
    urls, sizes, etags, buffers = _read_args(index, range(8))
    failed = reads.read_many(urls, sizes, etags, buffers)
    assert list(failed) == [3] and type(failed[3]) is OSError and failed[3].errno == errno.EIO
    assert f"after {attempts - 1} retries" in str(failed[3]) and "500" in str(failed[3])
    assert Counter(path for _, path, _, _ in s3env.requests("GET"))[f"/{BUCKET}/{_key(bad)}"] == attempts
    assert [bytes(buffers[k][0]) for k in (0, 7)] == [_content(s3env, index.paths[k]) for k in (0, 7)]
    with pytest.raises(StoreError, match="does not exist at this endpoint \\(404 NoSuchBucket\\)"):
        reads.read_many(["s3://no-such-bucket-here/a.jpg"], [1], [None], [[bytearray(1)]])


def test_errors_are_told_apart_by_their_type_not_their_text(s3env):
    """The clients' real exception objects, with messages that name other errors."""
    from botocore import exceptions as bx
    from obstore import exceptions as ox

    url = f"s3://{BUCKET}/a.jpg"
    misleading = "<Code>SignatureDoesNotMatch</Code><Code>NoSuchBucket</Code> status code: 412 timed out"

    def refusal(code: str, status: int, message: str = misleading) -> bx.ClientError:
        answer = {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return bx.ClientError(answer, "GetObject")

    def kind(e: BaseException) -> type:
        return type(client.classify(e, url))

    assert kind(ox.PermissionDeniedError(misleading)) is PermissionError  # a forbidden object, not the credentials
    assert kind(ox.UnauthenticatedError("status code: 404 <Code>NoSuchKey</Code>")) is StoreError
    assert kind(ox.PreconditionError("status code: 500")) is DatasetChangedError
    assert kind(FileNotFoundError(misleading)) is FileNotFoundError  # obstore's 404
    assert kind(ox.GenericError(misleading)) is OSError  # a try that failed: no status, no code, no timeout
    assert kind(ox.GenericError("Server returned non-2xx status code: 404 Not Found")) is OSError
    assert kind(refusal("NoSuchKey", 404)) is FileNotFoundError
    assert kind(refusal("AccessDenied", 403)) is PermissionError
    assert kind(refusal("InvalidAccessKeyId", 403, "status code: 404")) is StoreError
    assert kind(refusal("NoSuchBucket", 404, "<Code>NoSuchKey</Code>")) is StoreError
    assert kind(refusal("SlowDown", 503, "status code: 401 timed out")) is OSError
    assert kind(bx.ReadTimeoutError(endpoint_url="http://store")) is TimeoutError
    assert kind(bx.ConnectTimeoutError(endpoint_url="http://store")) is TimeoutError
    assert kind(bx.EndpointConnectionError(endpoint_url="http://timeout.example")) is OSError  # refused, not slow
    assert kind(bx.NoCredentialsError()) is StoreError
    assert kind(TimeoutError()) is TimeoutError  # a try coordl cut at COORDL_S3_TIMEOUT

    class UnauthenticatedError(Exception):  # obstore's name, not obstore's class
        pass

    assert kind(UnauthenticatedError("status code: 401 <Code>InvalidAccessKeyId</Code>")) is OSError
    throttled = refusal("SlowDown", 503)
    throttled.response["ResponseMetadata"]["RetryAttempts"] = 2  # botocore counts its own retries
    assert str(client.classify(throttled, url)).endswith("the store answered 503 SlowDown after 2 retries")
    assert str(client.classify(TimeoutError(), url, retries=1)).endswith(
        f"no complete answer within {client.settings().timeout_s:g} s after 1 retries"
    )


# -- settings, credentials, processes: scripts in a process of their own ---------------------


def _urls_index(root: str) -> str:
    """Code that builds ``index`` of ``root`` from a saved listing (no request to the store)."""
    index = Index.scan(root)
    data = {
        "paths": list(index.paths),
        "labels": index.labels.tolist(),
        "sizes": index.sizes.tolist(),
        "etags": list(index.etags),
    }
    return f"from coordl.index import Index\nindex = Index.build(**{json.dumps(data)!s})\n"


TIMEOUT_S, HANG_S = 2.0, 300.0  # the stalls last far longer than the tries, and than the epoch


def test_a_request_that_hangs_past_the_timeout_is_retried_then_fails_with_its_url(root, s3env, arrivals):
    index = Index.scan(root)
    once, always = index.paths[3], index.paths[70]
    s3env.hang(_key(once), HANG_S, times=1)
    s3env.hang(_key(always), HANG_S, times=100)
    code = _urls_index(root) + textwrap.dedent("""
        import json, time, coordl
        from coordl.errors import SampleError
        out = {}
        t0 = time.monotonic()
        with coordl.CoordLoader(index, batch_size=16, device_id=None, prep=1, cache=0, shuffle=True,
                                pipeline=coordl.ImageNetTrain(size=16), on_error="skip", return_index=True) as ld:
            out["seen"] = sorted(i for _, _, ids in ld for i in ids.tolist())
            out["skipped"] = ld.stats()["skipped_paths"]
        out["seconds"] = time.monotonic() - t0
        print(json.dumps(out))
    """)
    # 4 GETs in flight: a request that waits behind the others at the store (moto serves one at a time, slowly
    # on busy cores) stays far within the timeout, so that only the stalled ones reach it.
    env = {"COORDL_S3_TIMEOUT": str(TIMEOUT_S), "AWS_MAX_ATTEMPTS": "2", "COORDL_S3_REQUESTS": "4"}
    proc = _script(code, env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["seen"] == [i for i in range(N) if i != 70]  # sample 3 came on its second try
    assert out["skipped"] == [always]
    assert out["seconds"] < HANG_S  # the epoch did not wait for a stall to end
    tries = Counter(path for method, path, _, _ in s3env.requests("GET"))
    assert tries[f"/{BUCKET}/{_key(once)}"] == 2 and tries[f"/{BUCKET}/{_key(always)}"] == 2
    for path in (once, always):  # each stalled try was given up at the timeout, then tried again at once
        first, second = arrivals.times(f"/{BUCKET}/{_key(path)}")[:2]
        # Between the tries: the timeout, the retry's backoff (up to reads.INIT_BACKOFF_S) and the travel of
        # both to the proxy, which is 0.1 s on busy cores; a factor of 2 either way leaves room for that.
        assert TIMEOUT_S / 2 < second - first < 2 * TIMEOUT_S, (path, second - first)
    assert f"no complete answer within {TIMEOUT_S:g} s" in proc.stderr  # the skip's warning gives the reason


def test_refused_credentials_raise_store_error_at_once_whatever_on_error_says(tiny_dataset):
    local = Index.scan(tiny_dataset, index_dir="")
    with S3Server(auth=True) as s:
        s.create_bucket(BUCKET)
        s.upload_tree(tiny_dataset, BUCKET, "train")
        root = f"s3://{BUCKET}/train"
        # The index as a listing would give it (moto 5.2 refuses good signatures of listings whose prefix has a
        # "/", so this test lists with bad credentials only): URLs, sizes, and ETags (the MD5 of a simple PUT).
        paths = [root + "/" + p.split(str(tiny_dataset) + "/", 1)[1] for p in local.paths]
        etags = [f'"{hashlib.md5(Path(p).read_bytes()).hexdigest()}"' for p in local.paths]
        code = "import coordl\nfrom coordl.index import Index\n"
        code += (
            f"index = Index.build({paths!r}, {local.labels.tolist()!r}, {local.sizes.tolist()!r}, etags={etags!r})\n"
        )
        code += textwrap.dedent("""
            with coordl.CoordLoader(index, batch_size=8, device_id=None, on_error="skip", cache=0, shuffle=True,
                                    pipeline="imagenet-train") as ld:
                print(sum(len(labels) for _, labels in ld), ld.stats()["skipped"])
        """)
        proc = _script(code, s.env())
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split()[-2:] == [str(N), "0"]  # the good credentials read every sample

        bad = dict(s.env(), AWS_SECRET_ACCESS_KEY="not-the-secret")
        proc = _script(
            f"import coordl\ncoordl.CoordLoader({root!r}, batch_size=8, device_id=None, pipeline='imagenet-train')", bad
        )
        assert proc.returncode != 0
        assert (
            "StoreError: the object store refused coordl's credentials for s3://coordl-data/train (403" in proc.stderr
        )
        # An index made before the credentials went bad: the first batch stops the job, on_error="skip" or not.
        s.reset()
        proc = _script(code, bad)
        assert proc.returncode != 0
        assert "StoreError: the object store refused coordl's credentials for s3://coordl-data/train/" in proc.stderr
        assert "403 SignatureDoesNotMatch" in proc.stderr
        assert s.count("GET") <= 64  # stopped at the first batches, not a refusal per sample of the epoch


def test_credentials_and_the_endpoint_come_from_an_aws_profile(tiny_dataset, tmp_path):
    """No AWS_* credentials or endpoint in the environment: AWS_PROFILE names a profile of the shared
    files that holds them, as the AWS CLI would use it."""
    local = Index.scan(tiny_dataset, index_dir="")
    with S3Server(auth=True) as s:
        s.create_bucket(BUCKET)
        s.upload_tree(tiny_dataset, BUCKET, "train")
        (tmp_path / "credentials").write_text(
            f"[training]\naws_access_key_id = {s.access_key}\naws_secret_access_key = {s.secret_key}\n"
            "[stale]\naws_access_key_id = AKIAEXAMPLEEXAMPLE00\naws_secret_access_key = nope\n"
        )
        (tmp_path / "config").write_text(
            f"[profile training]\nregion = {s.region}\nendpoint_url = {s.endpoint}\n"
            f"[profile stale]\nregion = {s.region}\nendpoint_url = {s.endpoint}\n"
        )
        # None of the server's variables (no key, secret, region or endpoint): the profile says it all.
        env = {
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
            "AWS_CONFIG_FILE": str(tmp_path / "config"),
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        assert not any(k in os.environ for k in s.env() if k != "AWS_EC2_METADATA_DISABLED")
        paths = [f"s3://{BUCKET}/train/" + p.split(str(tiny_dataset) + "/", 1)[1] for p in local.paths]
        etags = [f'"{hashlib.md5(Path(p).read_bytes()).hexdigest()}"' for p in local.paths]
        code = "import coordl\nfrom coordl.index import Index\n"
        code += (
            f"index = Index.build({paths!r}, {local.labels.tolist()!r}, {local.sizes.tolist()!r}, etags={etags!r})\n"
        )
        code += textwrap.dedent("""
            with coordl.CoordLoader(index, batch_size=8, device_id=None, cache=0, shuffle=True,
                                    pipeline="imagenet-train") as ld:
                print(sum(len(labels) for _, labels in ld))
        """)
        proc = _script(code, dict(env, AWS_PROFILE="training"))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split()[-1] == str(N) and s.count("GET") == N
        proc = _script(code, dict(env, AWS_PROFILE="stale"))
        assert proc.returncode != 0 and "InvalidAccessKeyId" in proc.stderr, proc.stderr


LEAVING_SCRIPT = """
import sys
import coordl
loader = coordl.CoordLoader(sys.argv[1], batch_size=8, shuffle=False, device_id=None,
                            pipeline=coordl.ImageNetTrain(size=16), cache=0.5, prep=1)
for k, _ in enumerate(loader):
    if k == 0:
        print("leaving", flush=True)
        if sys.argv[2] == "raise":
            raise RuntimeError("the training step failed")
        break
print("left the loop")  # and ends without close()
"""


@pytest.mark.parametrize("how", ["break", "raise"])
def test_a_script_that_leaves_the_loop_with_requests_hung_exits_promptly_and_leaves_nothing(root, s3env, isolated, how):
    index = Index.scan(root)
    for i in range(24, 48):  # batches 3-5: in flight when the loop leaves after batch 0
        s3env.hang(_key(index.paths[i]), 60.0, times=100)
    code = LEAVING_SCRIPT.replace("sys.argv[1]", repr(root)).replace("sys.argv[2]", repr(how))
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "leaving\n"
        left = time.monotonic()
        stdout, stderr = proc.communicate(timeout=GUARD_S)
    finally:
        proc.kill()
        proc.wait()
    # The exit does not wait for the hung requests: not their 30 s timeout (COORDL_S3_TIMEOUT's default),
    # let alone its retries (the exit itself, the interpreter's end included, took 1-2 s, 12 s on busy cores).
    assert time.monotonic() - left < client.DEFAULT_TIMEOUT_S
    if how == "break":
        assert proc.returncode == 0 and "left the loop" in stdout, stderr
        assert "Traceback" not in stderr, stderr
    else:
        assert proc.returncode == 1 and stderr.rstrip().endswith("RuntimeError: the training step failed")
    assert any(status == 0 for *_, status, _ in s3env.requests("GET"))  # requests were hung at exit
    assert os.listdir(isolated) == []  # the cache left shared memory with the process


@pytest.mark.parametrize("how, status", [("close", 0), ("leave", 3)], ids=["closed-0", "left-with-gets-hung-3"])
def test_a_script_reading_s3_exits_with_its_own_status_and_no_thread_left_to_the_interpreters_end(
    root, s3env, isolated, how, status
):
    """The event loop and the object store's clients end at exit, before the interpreter finalizes:
    a thread still running then (with obstore's runtime calling back into it) can abort the process
    and lose the script's status. ``python tests/s3_exits.py --runs 20`` runs this 20 times in a row."""
    if how == "leave":
        index = Index.scan(root)
        for i in s3_exits.HUNG:
            s3env.hang(_key(index.paths[i]), 60.0, times=100)
    proc = s3_exits.run_exit_script(root, how, status)
    # The status, no warning, ResourceWarning, "Task was destroyed" or traceback under -X dev, no
    # thread of coordl's left running into the interpreter's end, nothing left in /dev/shm.
    assert s3_exits.clean(proc, status, str(isolated)) == []


KILLED_SCRIPT = """
import sys, time
import coordl
loader = coordl.CoordLoader(sys.argv[1], batch_size=8, shuffle=False, device_id=None,
                            pipeline=coordl.ImageNetTrain(size=16), cache=1.0, prep=1)
for k, _ in enumerate(loader):
    print("batch", k, flush=True)
    time.sleep(3600)  # killed here, with the GETs of later batches stuck and their cache slots reserved
"""


def test_a_process_killed_with_gets_in_flight_leaves_a_cache_the_next_loader_removes(root, s3env, isolated, arrivals):
    index = Index.scan(root)
    for i in range(24, 48):
        s3env.hang(_key(index.paths[i]), 60.0, times=1)  # once each: the killed process's requests
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT, root], env=full, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("batch 0")
        arrivals.wait(lambda gets: _stalled(gets) == 24, "the GETs of batches 3-5 stalled at the store")
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert os.listdir(isolated)  # the dead process's cache, with slots reserved for the stuck objects
    s3env.reset()
    with CoordLoader(
        root, batch_size=16, pipeline=RECIPE, device_id=None, return_index=True, cache=1.0, prep=1, shuffle=True
    ) as loader:
        stats = []
        for _ in range(2):
            seen = Counter(i for _, _, ids in loader for i in ids.tolist())
            assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
            stats.append(loader.stats())
    # The dead job's cache (slots reserved for the stuck objects included) was removed by the next loader,
    # which read every object once, exactly as its statistics say.
    delivered = sum(1 for _, path, status, _ in s3env.requests("GET") if status == 200 and "list-type" not in path)
    assert delivered == stats[0]["storage_reads"] == N
    assert stats[1]["storage_reads"] == 0 and stats[1]["cache_hits"] == N  # then the cache holds every sample
    assert os.listdir(isolated) == []


TORCH_SCRIPT = """
import json, sys
import numpy as np
import coordl
from coordl.datasets import ImageFolder

def to_array(image):
    return np.asarray(image.resize((16, 16)), dtype=np.uint8)

ds = ImageFolder(sys.argv[1], transform=to_array)
if sys.argv[2] == "read-first":
    ds[0]  # the main process reads an object itself before the workers fork
out = []
with coordl.CoordLoader(ds, batch_size=16, num_workers=2, return_index=True, cache=0.5, shuffle=True) as ld:
    for epoch in range(2):
        ids = sorted(i for _, _, idx in ld for i in idx.tolist())
        s = ld.stats()
        out.append({"ids": ids, "storage_reads": s["storage_reads"], "cache_items": s["cache_items"]})
print(json.dumps(out))
"""


@pytest.mark.parametrize("first", ["workers-only", "read-first"])
def test_the_torch_backend_reads_s3_in_forked_workers(root, s3env, first):
    full = dict(os.environ)
    full["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), full.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_SCRIPT, root, first],
        env=full,
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    epochs = json.loads(proc.stdout.splitlines()[-1])
    for e in epochs:
        assert e["ids"] == list(range(N))
    assert epochs[0]["storage_reads"] == N
    assert epochs[1]["storage_reads"] == N - epochs[1]["cache_items"]
    assert s3env.count("GET") == 2 * N - epochs[1]["cache_items"] + (first == "read-first")
    fallback = "reads with boto3 instead" in proc.stderr
    assert fallback == (first == "read-first"), proc.stderr  # obstore does not survive fork: boto3 then


# -- a multi-node job reads the store once ----------------------------------------------------


@pytest.mark.slow
def test_two_nodes_read_the_store_once_per_run(root, s3env, tmp_path):
    from test_peers import _records, _run_nodes

    out = tmp_path / "out"
    codes = _run_nodes(root, out, 2, ["--epochs", "3", "--cache", "0.6"], loopback=True)  # type: ignore[arg-type]
    assert codes == [0, 0], "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("node*.log")))
    recs = _records(out, 2)
    for epoch in range(3):
        seen = Counter(i for r in recs for b in r["epochs"][epoch]["batches"] for i in b)
        assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    assert s3env.count("GET") == N  # every sample once, in the first epoch, by one node or the other
    assert sum(r["epochs"][e]["stats"]["storage_reads"] for r in recs for e in range(3)) == N


# -- an HP group: one fetch for all its members -------------------------------------------------


def test_an_hp_group_on_s3_gets_each_object_once_for_all_its_members(root, s3env, procs):
    from test_hp_group import two_members

    outs = two_members(procs, root, "s3-sweep", 2, timeout=180)
    gets = s3env.count("GET")
    assert gets == sum(s["storage_reads"] for o in outs for s in o["stats"])
    # Once for the group (the cache holds the dataset), as with files: not once per member and epoch.
    assert N <= gets < 1.25 * N


# -- DS-Analyzer: S is the store's throughput, read as the loader reads ------------------------

ANALYZED = """
import sys, time
import coordl

with coordl.CoordLoader(sys.argv[1], batch_size=8, device_id=None, pipeline=coordl.ImageNetVal(size=32, resize=36),
                        cache=0.5, prep=1, shuffle=True) as loader:
    for epoch in range(100):
        for images, labels in loader:
            time.sleep(0.02)  # the training step
"""


def test_analyze_measures_the_store_with_requests_in_flight(root, s3env, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(ANALYZED)
    out = tmp_path / "out"
    s3env.latency_s = 0.05  # one request at a time would deliver 20 samples/s
    try:
        cmd = [
            sys.executable,
            "-m",
            "coordl.cli",
            "analyze",
            "--steps",
            "10",
            "--warmup",
            "2",
            "--out",
            str(out),
            "--storage-seconds",
            "3",
            "--",
            sys.executable,
            str(script),
            root,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    finally:
        s3env.latency_s = 0.0
    assert proc.returncode == 0, proc.stderr + proc.stdout
    phase = json.loads((out / "phase-S-rank0.json").read_text())
    assert phase["S_samples_per_s"] > 100, phase  # many GETs in flight, as the loader keeps them
    report = json.loads((out / "report.json").read_text())
    assert report["rates"]["S"] == pytest.approx(phase["S_bytes_per_s"], rel=0.01)

"""Audio clips on DALI: tones the tests write (a known frequency per class, at 16, 22.05, 44.1 and
48 kHz, mono and stereo, shorter and longer than the window, WAV, FLAC, Ogg Vorbis and Opus), the
audio recipes' windows, and every rule of the loader on them."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import coordl
from childproc import report, result
from coordl import AudioTrain, AudioVal, CoordLoader, SampleError, draws
from coordl.audio import formats
from coordl.tools.datagen.tones import make_tones, write_audio_shards

CTX = multiprocessing.get_context("spawn")
RATE = 8000
WINDOW = 8000  # 1 s: the clips are 0.5 to 3 s long
WHOLE = 3 * RATE + 8  # a window longer than every clip: the whole resampled clip, then zeros
BS = 6
SEED = 11


@pytest.fixture(scope="module")
def tones(tmp_path_factory):
    """24 clips: 4 classes of 6, every rate, mono and stereo, each format."""
    root = tmp_path_factory.mktemp("tones") / "train"
    return make_tones(
        root,
        classes=4,
        per_class=6,
        rates=(16000, 22050, 44100),
        channels=(1, 2),
        seconds=(0.5, 3.0),
        formats=("wav", "flac", "ogg", "opus"),
        seed=3,
    )


def _loader(data, recipe, **kw):
    kw.setdefault("shuffle", True)
    kw.setdefault("cache", 0)
    return CoordLoader(data, batch_size=BS, pipeline=recipe, device_id=None, return_index=True, seed=SEED, prep=1, **kw)


def _truth(tones, loader):
    """Each sample's record, by its position in the loader's index."""
    return [tones.truth(p) for p in loader.index.paths]


def _length(record) -> int:
    """The resampled clip's length: DALI's resampler gives ``ceil(frames * rate / file rate)``."""
    return math.ceil(record.frames * RATE / record.rate)


def _whole(root) -> dict[int, np.ndarray]:
    """Every sample's whole resampled clip (AudioVal with a window longer than every clip)."""
    out = {}
    with _loader(root, AudioVal(sample_rate=RATE, samples=WHOLE), shuffle=False) as loader:
        for x, _, ids in loader:
            for w, i in zip(x, ids.tolist()):
                out[i] = w[0].numpy().copy()
    return out


def _record(loader, out: dict, epoch: int, limit=None) -> list[int]:
    got = []
    for k, (x, y, ids) in enumerate(loader):
        for w, label, i in zip(x, y.tolist(), ids.tolist()):
            previous = out.setdefault((epoch, i), (w.clone(), label))
            assert torch.equal(previous[0], w) and previous[1] == label, f"sample {i} delivered twice, differently"
            got.append(i)
        if limit is not None and k + 1 == limit:
            break
    return got


# -- the recipes ---------------------------------------------------------------------------------
def test_every_clip_is_resampled_to_its_length_and_keeps_its_tone_within_one_fft_bin(tones):
    whole = _whole(tones.root)
    with _loader(tones.root, AudioVal(sample_rate=RATE, samples=WINDOW)) as loader:
        truth = _truth(tones, loader)
    assert len(whole) == len(truth) == 24
    seen = Counter((r.rate, r.channels, r.format) for r in truth)
    assert {r for r, _, _ in seen} == {16000, 22050, 44100, 48000} and {c for _, c, _ in seen} == {1, 2}
    for i, clip in whole.items():
        r, n = truth[i], _length(truth[i])
        assert np.all(clip[n:] == 0) and np.abs(clip[:n]).max() > 0.1, f"{r.path}: not {n} samples then zeros"
        spectrum = np.abs(np.fft.rfft(clip[:n]))
        peak = spectrum.argmax() * RATE / n
        assert abs(peak - r.frequency) <= RATE / n, f"{r.path}: strongest at {peak:.1f} Hz, its tone is {r.frequency}"


def _start(seed: int, epoch: int, i: int, length: int) -> int:
    """AudioTrain's window start, in DALI's float32 arithmetic: floor(u * (room + 1))."""
    u = draws.uniforms(seed, epoch, [i], 1)[0, 0]
    room = np.float32(max(length - WINDOW, 0))
    return int(np.floor(np.float32(u) * (room + np.float32(1.0))))


def test_a_training_window_is_the_span_of_the_whole_clip_its_draw_says(tones):
    whole = _whole(tones.root)
    out: dict = {}
    with _loader(tones.root, AudioTrain(sample_rate=RATE, samples=WINDOW)) as loader:
        truth = _truth(tones, loader)
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert sorted(_record(loader, out, epoch)) == list(range(24))
    short = 0
    for (epoch, i), (w, label) in out.items():
        assert w.shape == (1, WINDOW) and w.dtype == torch.float32 and label == truth[i].label
        n = _length(truth[i])
        start = _start(SEED, epoch, i, n)
        expected = np.zeros(WINDOW, np.float32)
        part = whole[i][start : min(start + WINDOW, n)]
        expected[: len(part)] = part
        assert np.array_equal(w[0].numpy(), expected), f"sample {i}, epoch {epoch}: not the span from {start}"
        short += n < WINDOW
    assert short > 0, "the set has clips shorter than the window: they end in zeros"
    moved = sum(not torch.equal(out[(0, i)][0], out[(1, i)][0]) for i in range(24) if _length(truth[i]) > WINDOW)
    assert moved >= 15, "a longer clip's window moves from epoch to epoch"


def test_the_centre_window_and_the_gain(tones):
    whole = _whole(tones.root)
    gain = (-6.0, 6.0)
    with _loader(tones.root, AudioVal(sample_rate=RATE, samples=WINDOW), shuffle=False) as loader:
        truth = _truth(tones, loader)
        for x, _, ids in loader:
            for w, i in zip(x, ids.tolist()):
                n = _length(truth[i])
                start = (n - WINDOW) // 2 if n > WINDOW else 0
                assert np.array_equal(w[0, : min(WINDOW, n)].numpy(), whole[i][start : start + min(WINDOW, n)])
    plain, louder = {}, {}
    for recipe, out in (
        (AudioTrain(sample_rate=RATE, samples=WINDOW), plain),
        (AudioTrain(RATE, WINDOW, gain), louder),
    ):
        with _loader(tones.root, recipe) as loader:
            _record(loader, out, 0)
    for (epoch, i), (w, _) in plain.items():
        g = gain[0] + (gain[1] - gain[0]) * draws.uniforms(SEED, epoch, [i], 2)[0, 1]
        np.testing.assert_allclose(louder[(epoch, i)][0].numpy(), w.numpy() * 10 ** (g / 20), rtol=1e-5, atol=1e-6)


# -- the loader's rules --------------------------------------------------------------------------
def test_a_run_resumed_from_2_ranks_on_3_delivers_the_uninterrupted_runs_windows(tones):
    recipe = AudioTrain(sample_rate=RATE, samples=WINDOW, gain=(-3.0, 3.0))
    reference: dict = {}
    with _loader(tones.root, recipe) as loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            _record(loader, reference, epoch)
    out: dict = {}
    before = [_loader(tones.root, recipe, shard=coordl.Shard(rank=r, world_size=2)) for r in range(2)]
    first = []
    try:
        for loader in before:
            first += _record(loader, out, 0, limit=1)
        state = json.loads(json.dumps(before[0].state_dict()))
    finally:
        for loader in before:
            loader.close()
    after = [_loader(tones.root, recipe, shard=coordl.Shard(rank=r, world_size=3)) for r in range(3)]
    rest = {0: [], 1: []}
    try:
        for loader in after:
            loader.load_state_dict(state)
            for epoch in (0, 1):
                loader.set_epoch(epoch)
                rest[epoch] += _record(loader, out, epoch)
    finally:
        for loader in after:
            loader.close()
    for key, (w, label) in out.items():
        assert torch.equal(w, reference[key][0]) and label == reference[key][1], f"{key} differs from the reference"
    assert set(first + rest[0]) == set(range(24)) and set(rest[1]) == set(range(24))
    assert len(first + rest[0]) - 24 < 3


def test_each_later_epoch_reads_exactly_the_clips_the_cache_does_not_hold(tones):
    with _loader(tones.root, AudioTrain(sample_rate=RATE, samples=WINDOW), cache=tones.total_bytes // 2) as loader:
        stats = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
            stats.append(loader.stats())
        total = loader.index.total_bytes
    assert stats[0]["storage_reads"] == 24 and 0 < stats[0]["cache_items"] < 24
    for s in stats[1:]:
        assert s["storage_reads"] == 24 - s["cache_items"] and s["cache_hits"] == s["cache_items"]
        assert s["storage_bytes"] == total - s["cache_bytes"]


def test_the_decoded_tier_holds_resampled_waveforms_and_gives_the_same_windows(tones):
    got, recipe = [], AudioTrain(sample_rate=RATE, samples=WINDOW, gain=(-3.0, 3.0))
    for cache in (0, coordl.Cache(size="256MB", decoded="64MB")):
        out: dict = {}
        with _loader(tones.root, recipe, cache=cache) as loader:
            for epoch in range(3):
                loader.set_epoch(epoch)
                _record(loader, out, epoch)
            stats = loader.stats()
        got.append(out)
    assert stats["decoded_hits"] == 24 and stats["storage_reads"] == 0, "later epochs came from the decoded tier"
    assert stats["decoded_cache_bytes"] == sum(4 * _length(r) for r in tones.records)  # float32 at 8 kHz
    for key, (w, _) in got[0].items():
        assert torch.equal(w, got[1][key][0]), f"{key} differs with the decoded tier"


def _member(root, group, q, start):
    def body():
        out = []
        with _loader(root, AudioTrain(sample_rate=RATE, samples=WINDOW), hp_group=group) as loader:
            start.wait(30)
            for epoch in range(2):
                loader.set_epoch(epoch)
                for x, _, ids in loader:
                    out += [
                        (epoch, i, w.numpy().tobytes().hex()[:64], float(w.double().sum()))
                        for w, i in zip(x, ids.tolist())
                    ]
            stats = loader.stats()
        return out, stats

    report(q, body)


def test_hp_group_trials_share_the_decoding_and_get_a_plain_loader_s_windows(tones, procs, isolated):
    plain = {}
    with _loader(tones.root, AudioTrain(sample_rate=RATE, samples=WINDOW)) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for x, _, ids in loader:
                for w, i in zip(x, ids.tolist()):
                    plain[(epoch, i)] = (w.numpy().tobytes().hex()[:64], float(w.double().sum()))
    start, q = CTX.Barrier(2), CTX.Queue()
    for _ in range(2):
        procs(_member, tones.root, "tones", q, start)
    members = [result(q, 180) for _ in range(2)]
    for out, _ in members:
        assert Counter((e, i) for e, i, *_ in out) == Counter(plain.keys()), "an epoch missed or repeated a sample"
        for epoch, i, head, total in out:
            assert (head, total) == plain[(epoch, i)], f"sample {i} of epoch {epoch} differs"
    assert sum(s["consumed_shared"] for _, s in members) > 0, "the trials shared nothing"


def test_tar_shards_with_audio_members_deliver_the_folder_s_windows(tones, tmp_path):
    shards = write_audio_shards(tones, tmp_path / "shards", per_shard=5)
    folder, tars = {}, {}
    for data, out in ((tones.root, folder), ([str(s) for s in shards], tars)):
        with _loader(data, "audio-train", cache=1.0) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                _record(loader, out, epoch)
            assert loader.stats()["storage_reads"] == 0
    assert len(shards) == 5 and folder.keys() == tars.keys()
    for key, (w, label) in folder.items():
        assert torch.equal(w, tars[key][0]) and label == tars[key][1], f"{key} differs over the shards"


def test_clips_in_s3_deliver_the_local_folder_s_windows(tones, s3_server, monkeypatch):
    s3_server.create_bucket("coordl-audio")
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3_server.upload_tree(tones.root, "coordl-audio", "train")
    local, store = {}, {}
    for data, out in ((tones.root, local), ("s3://coordl-audio/train", store)):
        with _loader(data, AudioTrain(sample_rate=RATE, samples=WINDOW)) as loader:
            _record(loader, out, 0)
    assert local.keys() == store.keys()
    for key, (w, label) in local.items():
        assert torch.equal(w, store[key][0]) and label == store[key][1]


# -- bad clips ------------------------------------------------------------------------------------
def _broken(tones, tmp_path) -> tuple[Path, dict[str, str]]:
    """A copy of the set with one broken clip of each kind: {file name: the reason's words}."""
    root = tmp_path / "broken"
    shutil.copytree(tones.root, root)
    folder = root / tones.classes[0]
    wav = next(r for r in tones.records if r.format == "wav")
    ogg = next(r for r in tones.records if r.format == "ogg")
    raw_wav, raw_ogg = Path(wav.path).read_bytes(), Path(ogg.path).read_bytes()
    (folder / "cut.wav").write_bytes(raw_wav[: len(raw_wav) // 2])
    (folder / "cut.ogg").write_bytes(raw_ogg[: len(raw_ogg) // 2])
    (folder / "text.flac").write_bytes(b"not audio at all " * 50)
    rate0 = bytearray(raw_wav)
    rate0[24:28] = (0).to_bytes(4, "little")
    (folder / "rate0.wav").write_bytes(bytes(rate0))
    empty = bytearray(raw_wav[:44])
    empty[40:44] = (0).to_bytes(4, "little")  # a data chunk of 0 bytes
    (folder / "empty.wav").write_bytes(bytes(empty))
    import soundfile

    soundfile.write(folder / "music.ogg", np.zeros(0, np.float32), 8000, format="OGG", subtype="VORBIS")
    return root, {
        "cut.wav": "it is truncated: its WAV data chunk says",
        "cut.ogg": "it is truncated: its last Ogg page is cut",
        "text.flac": "cannot decode sample",
        "rate0.wav": "its WAV header says a sample rate of 0",
        "empty.wav": "it holds no samples (a zero-length clip)",
        "music.ogg": "no samples (a zero-length clip)",
    }


def test_broken_clips_are_named_or_skipped_and_counted(tones, tmp_path):
    root, broken = _broken(tones, tmp_path)
    for name, words in broken.items():
        data = [(str(root / tones.classes[0] / name), 0)]
        with _loader(data, AudioVal(sample_rate=RATE, samples=WINDOW)) as loader:
            with pytest.raises(SampleError, match=re.escape(words)) as e:
                list(loader)
            assert e.value.path.endswith(name), name
    with _loader(str(root), AudioTrain(sample_rate=RATE, samples=WINDOW), on_error="skip") as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            delivered = sorted(i for _, _, ids in loader for i in ids.tolist())
            stats = loader.stats()
            assert len(delivered) == 24 and stats["skipped"] == len(broken), stats["skipped_paths"]
            assert sorted(os.path.basename(p) for p in stats["skipped_paths"]) == sorted(broken)


def test_header_faults_are_found_without_decoding(tones):
    good = {r.format: Path(r.path).read_bytes() for r in tones.records}
    assert all(formats.fault(raw) is None for raw in good.values())
    assert "truncated" in formats.fault(good["wav"][:-1]) and "truncated" in formats.fault(good["opus"][:-10])
    assert formats.fault(b"") == "the file is empty" and formats.fault(b"anything else") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_the_windows_arrive_on_the_device_equal_to_the_cpu_path_s(tones):
    """DALI decodes and resamples audio on the CPU only: the windows move to the device, the same floats."""
    got = {}
    for device in (None, 0):
        out = {}
        with CoordLoader(tones.root, batch_size=BS, pipeline=AudioTrain(RATE, WINDOW), device_id=device, seed=SEED,
                         shuffle=True, return_index=True) as loader:  # fmt: skip
            for x, _, ids in loader:
                assert x.is_cuda == (device is not None)
                for w, i in zip(x, ids.tolist()):
                    out[i] = w.cpu()
        got[device] = out
    assert all(torch.equal(got[None][i], got[0][i]) for i in range(24))

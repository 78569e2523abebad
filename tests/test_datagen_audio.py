"""Tests for coordl.tools.datagen's audio sets: sine tones per class, music-like clips, tar shards."""

from __future__ import annotations

import io
import os
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from coordl.index import Index
from coordl.tools.datagen import audiocodec, audioset
from coordl.tools.datagen.music import make_clips
from coordl.tools.datagen.tones import FREQS, ToneSet, make_tones, tone_frequency, write_audio_shards

sf = pytest.importorskip("soundfile")

ALL_FORMATS = ("wav", "flac", "ogg", "opus", "mp3")
SMALL = {"classes": 4, "per_class": 5, "seconds": (0.2, 0.6), "formats": ALL_FORMATS}


@pytest.fixture(scope="module")
def tones(tmp_path_factory: pytest.TempPathFactory) -> ToneSet:
    return make_tones(tmp_path_factory.mktemp("tones"), seed=3, **SMALL)


def files_of(root: Path) -> dict[str, bytes]:
    """Map each file's path relative to root to its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_class_folders_sort_in_class_order(tones: ToneSet) -> None:
    folders = sorted(e.name for e in os.scandir(tones.root) if e.is_dir())
    assert folders == list(tones.classes) == ["tone_0300hz", "tone_0500hz", "tone_0700hz", "tone_0900hz"]
    assert [tone_frequency(k) for k in range(4)] == [300, 500, 700, 900] == list(FREQS[:4])
    assert len(tones) == 20 and [r.path for r in tones.records] == sorted(r.path for r in tones.records)
    for r in tones.records:
        assert os.path.dirname(r.path) == os.path.join(tones.root, tones.classes[r.label])
        assert r.frequency == FREQS[r.label] and r.path.endswith("." + r.format)
    assert {r.format for r in tones.records if r.label == 0} == set(ALL_FORMATS)  # formats take turns
    assert tones.total_bytes == sum(os.path.getsize(r.path) for r in tones.records)
    index = Index.scan(tones.root, extensions=tuple("." + f for f in ALL_FORMATS), index_dir="")
    assert list(index.paths) == [r.path for r in tones.records]
    assert index.labels.tolist() == [r.label for r in tones.records]


def test_every_file_decodes_to_its_record_and_peaks_at_its_frequency(tones: ToneSet) -> None:
    for r in tones.records:
        samples, rate = sf.read(r.path, always_2d=True)
        assert (rate, samples.shape) == (r.rate, (r.frames, r.channels)), r
        assert r.rate == 48000 if r.format == "opus" else r.rate in (16000, 22050, 44100)
        assert 0.2 * r.rate - 1 <= r.frames <= 0.6 * r.rate + 1
        spectrum = np.abs(np.fft.rfft(samples.mean(axis=1)))
        assert abs(int(spectrum.argmax()) - r.frequency * r.frames / r.rate) <= 1, r
    assert tones.truth(tones.records[3].path) == tones.records[3]
    with pytest.raises(KeyError, match="not a file of the audio set"):
        tones.truth(os.path.join(tones.root, "nothing.wav"))


def test_a_rerun_writes_nothing_and_a_fresh_run_is_byte_identical(tmp_path: Path, tones: ToneSet) -> None:
    before = {p: os.stat(os.path.join(tones.root, p)).st_mtime_ns for p in files_of(Path(tones.root))}
    assert make_tones(tones.root, seed=3, **SMALL) == tones
    assert {p: os.stat(os.path.join(tones.root, p)).st_mtime_ns for p in before} == before
    again = make_tones(tmp_path / "again", seed=3, **SMALL)  # Ogg serial numbers included
    assert files_of(tmp_path / "again") == files_of(Path(tones.root))
    assert [r.size for r in again.records] == [r.size for r in tones.records]


def test_other_arguments_regenerate_and_drop_the_old_files(tmp_path: Path) -> None:
    first = make_tones(tmp_path, classes=3, per_class=3, seconds=(0.1, 0.2), formats=("wav",), seed=1)
    second = make_tones(tmp_path, classes=2, per_class=2, seconds=(0.1, 0.2), formats=("flac",), seed=1)
    assert first.total_bytes != second.total_bytes
    names = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert names == sorted([audioset.MANIFEST] + [os.path.relpath(r.path, tmp_path) for r in second.records])
    assert sorted(e.name for e in os.scandir(tmp_path) if e.is_dir()) == ["tone_0300hz", "tone_0500hz"]


def test_opus_files_are_at_48_khz(tmp_path: Path) -> None:
    opus = make_tones(tmp_path, classes=2, per_class=2, rates=(16000,), seconds=(0.2, 0.3), formats=("opus",))
    assert {r.rate for r in opus.records} == {48000}
    assert all(sf.info(r.path).samplerate == 48000 for r in opus.records)


def test_a_pool_writes_the_same_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = {"classes": 2, "per_class": 3, "seconds": (0.1, 0.2), "formats": ("ogg", "mp3", "wav")}
    alone = make_tones(tmp_path / "alone", **args)
    monkeypatch.setattr(audioset, "POOL_MIN_SAMPLES", 0)
    pooled = make_tones(tmp_path / "pooled", **args)
    assert files_of(tmp_path / "pooled") == files_of(tmp_path / "alone")
    assert [r.size for r in pooled.records] == [r.size for r in alone.records]


@pytest.mark.parametrize("fmt", ["ogg", "mp3"])
def test_clips_are_stereo_44k_music_in_genre_folders(tmp_path: Path, fmt: str) -> None:
    clips = make_clips(tmp_path, 3, classes=2, seconds=2.0, format=fmt, seed=5)
    assert sorted(e.name for e in os.scandir(tmp_path) if e.is_dir()) == list(clips.classes) == ["genre_00", "genre_01"]
    assert [os.path.relpath(r.path, tmp_path) for r in clips.records] == [
        f"genre_00/genre_00_0000.{fmt}",
        f"genre_00/genre_00_0001.{fmt}",
        f"genre_01/genre_01_0000.{fmt}",
    ]
    assert [r.label for r in clips.records] == [0, 0, 1]
    for r in clips.records:
        samples, rate = sf.read(r.path, always_2d=True, dtype="float32")
        assert (rate, samples.shape, r.format) == (44100, (88200, 2), fmt)
        assert (r.rate, r.channels, r.frames) == (44100, 2, 88200)
        assert 0.2 < np.abs(samples).max() <= 1.0 and samples.std() > 0.02  # music, not silence
        assert 55 < r.frequency < 440
    assert make_clips(tmp_path, 3, classes=2, seconds=2.0, format=fmt, seed=5) == clips


def test_shards_hold_every_sample_with_its_class(tmp_path: Path, tones: ToneSet) -> None:
    shards = write_audio_shards(tones, tmp_path / "shards", per_shard=6)
    assert [os.path.basename(s) for s in shards] == [f"shard-{k:06d}.tar" for k in range(4)]
    members = {}
    for shard in shards:
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                assert (m.mtime, m.uid, m.gid, m.mode) == (0, 0, 0, 0o644)
                members[m.name] = tar.extractfile(m).read()
    assert len(members) == 2 * len(tones)
    for r in tones.records:
        key = os.path.basename(r.path).rpartition(".")[0]
        assert members[f"{key}.{r.format}"] == Path(r.path).read_bytes()
        assert members[f"{key}.cls"] == str(r.label).encode()
    first = [Path(s).read_bytes() for s in shards]
    fewer = write_audio_shards(tones, tmp_path / "shards", per_shard=10)
    assert sorted(os.listdir(tmp_path / "shards")) == ["shard-000000.tar", "shard-000001.tar"]
    assert write_audio_shards(tones, tmp_path / "shards", per_shard=6) == shards
    assert [Path(s).read_bytes() for s in shards] == first and len(fewer) == 2


def test_ogg_serial_numbers_are_replaced_with_valid_checksums() -> None:
    buf = io.BytesIO()
    sf.write(buf, np.zeros((4000, 1), np.float32), 16000, format="OGG", subtype="VORBIS")
    data = buf.getvalue()
    serial = int.from_bytes(data[14:18], "little")
    assert audiocodec.set_ogg_serial(data, serial) == data  # libsndfile's own checksums, recomputed
    patched = audiocodec.set_ogg_serial(data, 7)
    assert patched.count((7).to_bytes(4, "little")) >= 2
    assert sf.read(io.BytesIO(patched))[0].shape == (4000,)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"classes": 0}, ValueError, "classes must be between 1 and 16"),
        ({"classes": 17}, ValueError, "classes must be between 1 and 16"),
        ({"per_class": 2.0}, TypeError, "per_class must be an integer"),
        ({"formats": ("aac",)}, ValueError, "formats must be among"),
        ({"formats": ()}, ValueError, "formats must be a non-empty tuple"),
        ({"formats": ("mp3",), "rates": (96000,)}, ValueError, "MP3 files can be written at"),
        ({"channels": (3,)}, ValueError, "a channel count must be between 1 and 2"),
        ({"seconds": (2.0, 1.0)}, ValueError, "seconds must be a"),
        ({"seconds": (0.0, 1.0)}, ValueError, "seconds must be a"),
        ({"seconds": 1.0}, ValueError, "seconds must be a"),
        ({"rates": (4000,)}, ValueError, "a rate must be between 8000"),
        ({"noise": -1.0}, ValueError, "noise must be a number between 0.0 and 0.2"),
    ],
)
def test_bad_arguments_are_refused(tmp_path: Path, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make_tones(tmp_path, **kwargs)
    assert not list(tmp_path.iterdir())


def test_bad_clip_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="audio formats must be among"):
        make_clips(tmp_path, 1, format="aac")
    with pytest.raises(ValueError, match="num_clips must be >= 1"):
        make_clips(tmp_path, 0)
    with pytest.raises(ValueError, match="MP3 files can be written at"):
        make_clips(tmp_path, 1, format="mp3", rate=96000)
    with pytest.raises(ValueError, match="seconds must be a number >= 0.001"):
        make_clips(tmp_path, 1, seconds=0.0)
    with pytest.raises(ValueError, match="has no tone"):
        tone_frequency(len(FREQS))
    assert not list(tmp_path.iterdir())


def test_without_soundfile_the_error_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "soundfile", None)
    with pytest.raises(ImportError, match="pip install soundfile"):
        make_tones(tmp_path, classes=1, per_class=1, seconds=(0.1, 0.1))

"""Encode sample arrays as WAV, FLAC, Ogg Vorbis, Opus or MP3 bytes with soundfile, deterministically.

libsndfile (through soundfile) writes every format; it gives each Ogg stream (Vorbis, Opus) a
random serial number, though, so two encodings of the same samples differ in those 4 bytes of
every page and in the pages' checksums. :func:`encode` sets the serial number to the caller's
(:func:`set_ogg_serial`), so the bytes are a function of the samples and the serial alone.
libsndfile writes Opus at 8, 12, 16, 24 and 48 kHz only, and MP3 at the MPEG rates
(:data:`MP3_RATES`). soundfile is imported when first needed: it is an optional dependency.
"""

from __future__ import annotations

import io
import struct
import zlib
from types import ModuleType

import numpy as np

__all__ = ["FORMATS", "MP3_RATES", "OPUS_RATE", "check_formats", "encode", "set_ogg_serial", "soundfile"]

# extension -> (libsndfile container, subtype)
FORMATS = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "ogg": ("OGG", "VORBIS"),
    "opus": ("OGG", "OPUS"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
}
OPUS_RATE = 48000  # the one rate at which every Opus file is written
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)  # MPEG-1, 2 and 2.5


def check_formats(formats: tuple[str, ...], rates: tuple[int, ...]) -> None:
    """Check that every format is one of :data:`FORMATS`, and that MP3 files are asked for at rates MP3 has.

    Raises:
        ValueError: If a format is unknown or an MP3 file would have a rate MPEG audio lacks.
    """
    if unknown := [f for f in formats if f not in FORMATS]:
        raise ValueError(f"audio formats must be among {sorted(FORMATS)}, got {unknown}")
    if "mp3" in formats and (odd := [r for r in rates if r not in MP3_RATES]):
        raise ValueError(f"MP3 files can be written at {MP3_RATES} Hz only, not {odd}: choose other rates or formats")


def encode(samples: np.ndarray, rate: int, fmt: str, serial: int) -> bytes:
    """``samples`` (float, ``(frames, channels)``) as the bytes of a ``fmt`` file (a key of :data:`FORMATS`).

    Raises:
        ImportError: If soundfile is not installed.
    """
    container, subtype = FORMATS[fmt]
    buf = io.BytesIO()
    soundfile().write(buf, samples, rate, format=container, subtype=subtype)
    data = buf.getvalue()
    return set_ogg_serial(data, serial) if container == "OGG" else data


def soundfile() -> ModuleType:
    """The soundfile module, imported now: it is an optional dependency.

    Raises:
        ImportError: If soundfile is not installed (the message says how to install it).
    """
    try:
        import soundfile
    except ImportError as e:
        raise ImportError(
            f"writing audio files needs the soundfile package ({e}); install it with: pip install soundfile"
        ) from e
    return soundfile


_BIT_REVERSED = bytes(int(f"{b:08b}"[::-1], 2) for b in range(256))


def set_ogg_serial(data: bytes, serial: int) -> bytes:
    """The Ogg stream ``data`` with every page's serial number set to ``serial`` and its checksum redone.

    Raises:
        ValueError: If ``data`` is not a sequence of Ogg pages.
    """
    out = bytearray(data)
    pos = 0
    while pos < len(out):
        if out[pos : pos + 4] != b"OggS" or pos + 27 > len(out):
            raise ValueError(f"not an Ogg page at byte {pos} of {len(out)}")
        segments = out[pos + 26]
        end = pos + 27 + segments + sum(out[pos + 27 : pos + 27 + segments])
        struct.pack_into("<I", out, pos + 14, serial & 0xFFFFFFFF)
        struct.pack_into("<I", out, pos + 22, 0)
        # Ogg's CRC-32 is zlib's polynomial taken MSB first, from 0, not inverted: zlib's on bit-reversed bytes.
        crc = zlib.crc32(bytes(out[pos:end]).translate(_BIT_REVERSED), 0xFFFFFFFF) ^ 0xFFFFFFFF
        struct.pack_into("<I", out, pos + 22, int(f"{crc:032b}"[::-1], 2))
        pos = end
    return bytes(out)

"""Pure: the audio formats DALI's decoder reads, and the faults of a clip its header shows.

DALI's ``fn.decoders.audio`` (libsndfile) reads WAV, FLAC and Ogg (Vorbis and Opus); it does not
read MP3 (measured with DALI 2.4: an MP3 file fails to open). Some broken clips it decodes without
an error: a WAV file cut short gives the samples that are there, an Ogg Vorbis stream cut short
may give none, and an empty clip gives none. :func:`fault` reads the header to tell them apart from
good clips, before anything is decoded: a WAV file's ``fmt`` and ``data`` chunks (a sample rate or a
channel count of 0, a ``data`` chunk longer than the file, or empty), and an Ogg stream's last page
(the stream's end is marked on its last page; a stream cut short has no such page). A FLAC file cut
short fails in the decoder, as do files that are not audio.
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = ["AUDIO_EXTENSIONS", "fault"]

#: The file endings an audio dataset's samples have (the formats DALI's decoder reads).
AUDIO_EXTENSIONS = (".wav", ".flac", ".ogg", ".opus", ".oga")

_OGG_END = 0x04  # an Ogg page's header type: the last page of its logical stream
_OGG_MAX_PAGE = 27 + 255 + 255 * 255  # the largest page: the last one starts this close to the end


def fault(data) -> str | None:
    """Why the clip ``data`` (its bytes, a uint8 array or ``bytes``) is broken, from its header, or
    None when the header shows nothing wrong (or the format is not one checked here)."""
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    if len(raw) == 0:
        return "the file is empty"
    if raw[:4] in (b"RIFF", b"RIFX") and raw[8:12] == b"WAVE":
        return _wav(raw)
    if raw[:4] == b"OggS":
        return _ogg(raw)
    return None


def _wav(raw: bytes) -> str | None:
    order = "<" if raw[:4] == b"RIFF" else ">"
    at, rate, channels = 12, None, None
    while at + 8 <= len(raw):
        name, size = raw[at : at + 4], struct.unpack(order + "I", raw[at + 4 : at + 8])[0]
        body = at + 8
        if name == b"fmt " and body + 8 <= len(raw):
            channels, rate = struct.unpack(order + "HI", raw[body + 2 : body + 8])
            if rate == 0:
                return "its WAV header says a sample rate of 0"
            if channels == 0:
                return "its WAV header says 0 channels"
        if name == b"data":
            if rate is None:
                return "its WAV data comes before its format (no fmt chunk)"
            if size == 0:
                return "it holds no samples (a zero-length clip)"
            if size != 0xFFFFFFFF and body + size > len(raw):  # 0xFFFFFFFF: a stream's unknown length
                return f"it is truncated: its WAV data chunk says {size} bytes, the file holds {len(raw) - body}"
            return None
        at = body + size + (size & 1)  # chunks are padded to an even size
    return "it is truncated: no WAV data chunk" if rate is not None else "its WAV header has no fmt chunk"


def _ogg(raw: bytes) -> str | None:
    """The stream's last page must end at the file's end and be marked as the end (a page's
    capture pattern may also occur inside a page's data: such a match does not end at the end)."""
    at = len(raw)
    while True:
        at = raw.rfind(b"OggS", max(0, len(raw) - _OGG_MAX_PAGE), at)
        if at < 0:
            return "it is truncated: its last Ogg page is cut"
        if _page_end(raw, at) == len(raw):
            break
    if not raw[at + 5] & _OGG_END:
        return "it is truncated: its Ogg stream has no end page"
    return None


def _page_end(raw: bytes, at: int) -> int | None:
    """Where the Ogg page starting at ``at`` ends (its header, segment table and data), or None."""
    if at + 27 > len(raw) or raw[at + 4] != 0:  # version 0
        return None
    segments = raw[at + 26]
    if at + 27 + segments > len(raw):
        return None
    return at + 27 + segments + sum(raw[at + 27 : at + 27 + segments])

"""Pack a generated audio set into deterministic WebDataset tar shards.

One sample per file, in the set's path order (class by class): members ``<key>.<ext>`` (the
file's bytes) and ``<key>.cls`` (its class index as decimal text), where ``key`` is the file's
name without its extension (``tone_0300hz_0007``: unique, since it names the class). Shards
are plain ustar archives with zero mtimes, owners 0 and mode 0644, so the same set always
gives the same bytes.
"""

from __future__ import annotations

import io
import os
import re
import tarfile

from coordl.tools.datagen.audioset import ToneSet, check_count
from coordl.tools.datagen.job import write_atomic

__all__ = ["write_audio_shards"]

_SHARD_NAME = re.compile(r"^shard-(\d{6})\.tar$")


def write_audio_shards(tones: ToneSet, out_dir: str | os.PathLike[str], per_shard: int = 50) -> list[str]:
    """Pack ``tones`` into tar shards ``out_dir/shard-000000.tar``, ..., ``per_shard`` samples each.

    Shards are written atomically; shards of an earlier, larger run left in ``out_dir`` are deleted.

    Args:
        tones: The set, from :func:`~.audio.make_tones` or :func:`~.music.make_clips`.
        out_dir: Folder of the shards; created if missing.
        per_shard: Samples per shard (the last one may hold fewer).

    Returns:
        The shards' paths, in order.

    Raises:
        TypeError: If ``per_shard`` is not an integer.
        ValueError: If ``per_shard`` is below 1.
    """
    per_shard = check_count("per_shard", per_shard, 1)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    records = sorted(tones.records, key=lambda r: r.path)
    paths = []
    for start in range(0, len(records), per_shard):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for record in records[start : start + per_shard]:
                key = os.path.basename(record.path).rpartition(".")[0]
                with open(record.path, "rb") as f:
                    _add_member(tar, f"{key}.{record.format}", f.read())
                _add_member(tar, f"{key}.cls", str(record.label).encode())
        paths.append(os.path.join(out_dir, f"shard-{len(paths):06d}.tar"))
        write_atomic(paths[-1], buf.getvalue())
    for name in os.listdir(out_dir):
        m = _SHARD_NAME.match(name)
        if m and int(m.group(1)) >= len(paths):
            os.remove(os.path.join(out_dir, name))
    return paths


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    member = tarfile.TarInfo(name)
    member.size, member.mode, member.mtime, member.uid, member.gid = len(data), 0o644, 0, 0, 0
    tar.addfile(member, io.BytesIO(data))

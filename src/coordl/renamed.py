"""The spellings of earlier versions: each is refused with a ``TypeError`` that names what says
the same now (docs/migration.md lists them), rather than being taken silently or failing with
Python's bare "unexpected keyword argument"."""

from __future__ import annotations

import functools

__all__ = ["RENAMED", "refuse_renamed", "refusing"]


#: Arguments of earlier versions, and what says the same now.
RENAMED = {
    "cache_bytes": "cache= (cache='40GB', or coordl.Cache(size=...))",
    "decoded_cache": "cache=coordl.Cache(size=..., decoded=...)",
    "keep_cache": "cache=coordl.Cache(..., keep=True)",
    "num_threads": "prep=coordl.Prep(threads=...)",
    "io_threads": "fetch=coordl.Fetch(threads=...)",
    "prefetch_batches": "fetch=coordl.Fetch(batches_ahead=...)",
    "rank": "shard=coordl.Shard(rank=..., world_size=...)",
    "world_size": "shard=coordl.Shard(rank=..., world_size=...)",
    "locality_aware": "peers=coordl.Peers(locality_aware=...)",
    "peer_timeout": "peers=coordl.Peers(timeout=...)",
    "peer_retry_after": "peers=coordl.Peers(retry_after=...)",
    "peer_interface": "peers=coordl.Peers(interface=...)",
    "peer_port": "peers=coordl.Peers(port=...)",
    "hp_staging": "hp_group=coordl.HPGroup(name, staging=...)",
    "hp_idle_timeout": "hp_group=coordl.HPGroup(name, idle_timeout=...)",
    "extensions": "data=coordl.Index.scan(root, extensions=...)",
    "index_dir": "data=coordl.Index.scan(root, index_dir=...)",
}


def refusing(renamed: dict[str, str], owner: str):
    """A decorator of ``owner``'s ``__init__`` that names the new spelling of an argument of an
    earlier version (a ``TypeError``, as for any unknown argument); ``inspect.signature`` still
    shows ``__init__``'s own parameters."""

    def wrap(init):
        @functools.wraps(init)
        def checked(self, *args, **kwargs):
            old = sorted(renamed.keys() & kwargs.keys())
            if old:
                raise TypeError(
                    f"{owner} does not take "
                    + "; ".join(f"{name}= any more: pass {renamed[name]}" for name in old)
                    + " (docs/migration.md#from-coordl-01 lists every one)"
                )
            return init(self, *args, **kwargs)

        return checked

    return wrap


refuse_renamed = refusing(RENAMED, "CoordLoader")

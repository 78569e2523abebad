"""A user's training script, for tests/test_shared_machine.py: two epochs over a dataset, then one
line of JSON on stdout: a digest of every batch, the cache's hits per epoch, every warning the
script got, and the names of its node cache and of its HP group (``--hp-group``, default "sweep"),
this user's, as coordl makes them.

    python shared_machine_train.py ROOT [--cache FRACTION] [--keep] [--hp-group NAME]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import warnings

import coordl
from coordl.fetch.spec import CacheSpec
from coordl.staging.layout import group_fingerprint


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--cache", type=float, default=0.0)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--hp-group")
    a = p.parse_args()
    cache = coordl.Cache(size=a.cache, keep=a.keep) if a.cache else 0
    batches, stats = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with coordl.CoordLoader(
            a.root,
            8,
            pipeline=coordl.ImageNetTrain(size=16),
            device_id=None,
            shuffle=True,
            cache=cache,
            hp_group=a.hp_group,
            prep=1,
            fetch=coordl.Fetch(threads=2),
        ) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                for images, labels in loader:
                    batches.append(hashlib.sha256(images.numpy().tobytes() + labels.numpy().tobytes()).hexdigest())
                s = loader.stats()
                stats.append({k: s[k] for k in ("cache_hits", "storage_reads")})
            index = loader.index
    names = {
        "cache": CacheSpec.for_dataset(index, 0).fingerprint,
        "hp_group": group_fingerprint(a.hp_group or "sweep", 0),
    }
    warned = [f"{w.category.__name__}: {w.message}" for w in caught]
    print(json.dumps({"batches": batches, "stats": stats, "warnings": warned, "names": names}))


if __name__ == "__main__":
    main()

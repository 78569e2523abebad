"""Golden hashes: every kind of recipe's delivered batches, bit for bit, on small generated datasets.

Each case runs a real :class:`~coordl.CoordLoader` (DALI on the CPU) over two epochs with fixed
seeds and hashes every delivered batch (its tensors' dtype, shape and bytes; its targets, boxes
included; its sample ids). The expected hashes in ``recipe_goldens.json`` were taken on the code
before recipes became objects, so a refactoring of how recipes are interpreted must deliver the
same bits on every path: the encoded pipeline, the decoded tier's mixed and decoded-only
pipelines, the uint8 staging of an HP group.

The hashes belong to this machine's decoders (DALI's, Pillow's encoder of the test images, the
codecs of the audio clips): after an upgrade of one of them, regenerate the file on the old code
with ``python tests/test_recipe_goldens.py`` and check the change alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import coordl
from coordl import AudioTrain, AudioVal, CoordLoader, DecodedRecipe, ImageNetTrain, ImageNetVal, SSDTrain, SSDVal

sys.path.insert(0, str(Path(__file__).parent))
from conftest import make_tree  # noqa: E402

GOLDENS = Path(__file__).with_name("recipe_goldens.json")
BIG = "256MB"
EPOCHS = 2


def _grey_crop(images, ctx):
    """A user's function of decoded images: a fixed crop, flipped by a draw of ``ctx.random``."""
    from nvidia.dali import fn, types

    images = fn.resize(images, device=ctx.device, resize_x=40, resize_y=40)
    return fn.crop_mirror_normalize(
        images,
        device=ctx.device,
        dtype=types.UINT8,
        crop=(32, 32),
        mirror=ctx.random.coin_flip(0.5),
        output_layout="CHW",
    )


def _on_bytes(encoded, ctx):
    """A user's callable on encoded bytes: decode, resize, a drawn brightness."""
    from nvidia.dali import fn, types

    images = fn.decoders.image(encoded, device=ctx.decoder_device, output_type=types.RGB)
    images = fn.resize(images, device=ctx.device, resize_x=24, resize_y=24)
    images = fn.brightness(images, device=ctx.device, brightness=0.5 + ctx.random.uniform())
    return fn.transpose(images, perm=[2, 0, 1])


def _half_decoded(root: Path) -> int:
    """Bytes of half the images decoded at their own resolution: a tier that serves some samples
    decoded and the rest encoded."""
    total = 0
    for p in sorted(root.rglob("*.jpg")):
        w, h = Image.open(p).size
        total += w * h * 3
    return total // 2


def _datasets(root: Path) -> dict:
    from coordl.tools.datagen.coco import make_coco
    from coordl.tools.datagen.tones import make_tones

    images = make_tree(root / "images", classes=3, per_class=8, seed=7)
    coco = make_coco(root / "coco", 16, seed=3, width=(96, 160), height=(80, 140), boxes=(0, 3), crowd=0.1)
    tones = make_tones(
        root / "tones",
        classes=2,
        per_class=4,
        rates=(16000, 22050),
        channels=(1, 2),
        seconds=(0.5, 2.0),
        formats=("wav", "flac", "ogg"),
        seed=3,
    )
    return {"images": images, "coco": coco, "tones": tones}


def _cases(data: dict) -> dict:
    """Every case: ``name -> (data, loader arguments)``."""
    images = str(data["images"])
    coco = coordl.Index.from_coco(data["coco"].images, data["coco"].annotations)
    tones = str(data["tones"].root)
    tier = coordl.Cache(size=BIG, decoded=BIG)
    half = coordl.Cache(size=BIG, decoded=_half_decoded(data["images"]))
    small_ssd = SSDTrain(size=64)
    audio_train = AudioTrain(samples=6000, gain=(-6.0, 3.0))
    audio_val = AudioVal(samples=6000)
    return {
        "imagenet-train": (images, dict(pipeline=ImageNetTrain(size=32))),
        "imagenet-train-uint8": (images, dict(pipeline=ImageNetTrain(size=32, dtype="uint8"))),
        "imagenet-train-capped": (images, dict(pipeline=ImageNetTrain(size=32, max_short_side=40))),
        "imagenet-train-by-name": (images, dict(pipeline="imagenet-train")),
        "imagenet-val": (images, dict(pipeline=ImageNetVal(size=32, resize=40))),
        "imagenet-val-capped": (images, dict(pipeline=ImageNetVal(size=32, resize=36, max_short_side=44))),
        "imagenet-train-decoded-tier": (images, dict(pipeline=ImageNetTrain(size=32), cache=tier)),
        "imagenet-train-half-tier": (images, dict(pipeline=ImageNetTrain(size=32), cache=half)),
        "imagenet-train-capped-tier": (images, dict(pipeline=ImageNetTrain(size=32, max_short_side=40), cache=tier)),
        "imagenet-val-decoded-tier": (images, dict(pipeline=ImageNetVal(size=32, resize=40), cache=tier)),
        "decoded-recipe": (images, dict(pipeline=DecodedRecipe(_grey_crop))),
        "decoded-recipe-tier": (images, dict(pipeline=DecodedRecipe(_grey_crop), cache=tier)),
        "callable": (images, dict(pipeline=_on_bytes)),
        "imagenet-train-hp-uint8": (images, dict(pipeline=ImageNetTrain(size=32), hp_group="goldens", uint8=True)),
        "imagenet-val-hp-stage": (
            images,
            dict(pipeline=ImageNetVal(size=32, resize=40), hp_group=coordl.HPGroup("goldens-v", stage_batch=10)),
        ),
        "ssd-train": (coco, dict(pipeline=small_ssd)),
        "ssd-train-plain-colour": (
            coco,
            dict(
                pipeline=SSDTrain(
                    size=48, brightness=(1, 1), contrast=(1, 1), saturation=(1, 1), hue=(0, 0), dtype="uint8"
                )
            ),
        ),
        "ssd-val": (coco, dict(pipeline=SSDVal(size=64))),
        "ssd-train-decoded-tier": (coco, dict(pipeline=small_ssd, cache=tier)),
        "ssd-val-decoded-tier": (coco, dict(pipeline=SSDVal(size=64), cache=tier)),
        "ssd-train-hp": (coco, dict(pipeline=small_ssd, hp_group="goldens-ssd")),
        "audio-train": (tones, dict(pipeline=audio_train)),
        "audio-val": (tones, dict(pipeline=audio_val)),
        "audio-train-by-name": (tones, dict(pipeline="audio-train")),
        "audio-train-decoded-tier": (tones, dict(pipeline=audio_train, cache=tier)),
        "audio-val-hp": (tones, dict(pipeline=audio_val, hp_group="goldens-audio")),
    }


def _update(h, x) -> None:
    """Feeds a delivered value to the hash: tensors by dtype, shape and bytes; dicts and lists in order."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    elif isinstance(x, dict):
        for k in sorted(x):
            h.update(str(k).encode())
            _update(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(f"[{len(x)}".encode())
        for v in x:
            _update(h, v)
    else:
        h.update(repr(x).encode())


def run_case(data, kw: dict) -> list[list[str]]:
    """The hashes of every batch of :data:`EPOCHS` epochs, epoch by epoch."""
    kw = dict(kw)
    uint8 = kw.pop("uint8", False)
    kw.setdefault("cache", 0)
    old = os.environ.get("COORDL_HP_STAGE_UINT8")
    if uint8:
        os.environ["COORDL_HP_STAGE_UINT8"] = "1"
    try:
        with CoordLoader(
            data, batch_size=5, device_id=None, shuffle=True, seed=21, prep=2, return_index=True, **kw
        ) as ld:
            out = []
            for epoch in range(EPOCHS):
                ld.set_epoch(epoch)
                hashes = []
                for batch in ld:
                    h = hashlib.sha256()
                    _update(h, batch)
                    hashes.append(h.hexdigest()[:24])
                out.append(hashes)
            return out
    finally:
        if uint8:
            if old is None:
                os.environ.pop("COORDL_HP_STAGE_UINT8", None)
            else:
                os.environ["COORDL_HP_STAGE_UINT8"] = old


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return _cases(_datasets(tmp_path_factory.mktemp("goldens")))


def _expected() -> dict:
    if not GOLDENS.exists():  # only while ``_write`` makes it
        return {}
    return json.loads(GOLDENS.read_text())["cases"]


@pytest.mark.parametrize("name", sorted(_expected()))
def test_a_recipe_delivers_its_golden_bits(cases, name):
    data, kw = cases[name]
    got = run_case(data, kw)
    want = _expected()[name]
    assert [len(e) for e in got] == [len(e) for e in want], f"{name}: another number of batches"
    for epoch, (g, w) in enumerate(zip(got, want, strict=True)):
        differ = [k for k, (a, b) in enumerate(zip(g, w, strict=True)) if a != b]
        assert not differ, f"{name}: epoch {epoch}'s batches {differ} differ from the golden hashes"


def test_every_case_has_a_golden(cases):
    assert sorted(cases) == sorted(_expected())


def _write(root: Path) -> None:
    """Regenerates the golden file (run on the code the hashes are to be taken from)."""
    cases = _cases(_datasets(root))
    first = {name: run_case(d, kw) for name, (d, kw) in cases.items()}
    again = {name: run_case(d, kw) for name, (d, kw) in cases.items()}
    unstable = [n for n in cases if first[n] != again[n]]
    if unstable:
        raise SystemExit(f"not deterministic: {unstable}")
    doc = {"taken_on": os.environ.get("GOLDENS_COMMIT", "?"), "cases": first}
    GOLDENS.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(first)} cases to {GOLDENS}")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        os.environ["COORDL_SHM_DIR"] = shm
        os.environ["COORDL_INDEX_DIR"] = os.path.join(tmp, "indexes")
        _write(Path(tmp))

"""The ``coordl`` command as a user runs it: demo, cache ls / clean, make-dataset."""

import glob
import os
import subprocess
import sys

import coordl


def run(*args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "coordl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or os.environ.copy(),
        check=False,
    )


def test_demo_fills_the_cache_then_hits_it(tmp_path):
    r = run("demo", "--images", "60", "--classes", "3", "--batch-size", "16", "--quiet", "--dir", str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr
    assert "60 files in 3 classes" in r.stdout
    lines = [ln.split() for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit() and len(ln.split()) == 9]
    assert [row[0] for row in lines] == ["0", "1"]
    e0, e1 = lines
    assert e0[4] == "0" and e0[5] == "60"  # epoch 0: no hits, everything from storage
    assert int(e1[4]) > 0 and int(e1[4]) + int(e1[5]) == 60  # epoch 1: hits + storage = dataset
    assert not os.listdir(os.environ["COORDL_SHM_DIR"])


def test_cache_ls_and_clean(tiny_dataset):
    r = run("cache", "ls")
    assert r.returncode == 0 and "no coordl shared memory" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("memory limit: ")  # the limit shared memory counts against
    with coordl.CoordLoader(
        tiny_dataset,
        batch_size=30,
        device_id=None,
        pipeline=coordl.ImageNetTrain(size=32),
        cache=coordl.Cache(size=0.5, keep=True),
        shuffle=True,
    ) as loader:
        for _ in loader:
            pass
        fp = loader.node_cache.fingerprint  # the group: the dataset's fingerprint and the user's
        r = run("cache", "ls")
        assert fp in r.stdout and "in use" in r.stdout and "kept warm" in r.stdout
        r = run("cache", "clean")
        assert "left 1 group(s) in use" in r.stdout and fp not in r.stdout.split("left")[0]
    r = run("cache", "ls")
    assert fp in r.stdout and "unused, kept warm" in r.stdout
    r = run("cache", "clean", "--keep-warm")
    assert "nothing to remove" in r.stdout
    r = run("cache", "clean")
    assert f"removed {fp}" in r.stdout
    assert not os.listdir(os.environ["COORDL_SHM_DIR"])


def test_make_dataset(tmp_path):
    r = run(
        "make-dataset",
        str(tmp_path / "ds"),
        "--images",
        "12",
        "--classes",
        "3",
        "--width",
        "64",
        "--height",
        "48",
        "-q",
    )
    assert r.returncode == 0, r.stderr
    assert "12 files in 3 classes" in r.stdout
    assert len(coordl.Index.scan(tmp_path / "ds")) == 12


def test_make_dataset_of_a_size(tmp_path):
    root = tmp_path / "ds"
    args = ("make-dataset", str(root), "--size", "200KB", "--classes", "3", "--width", "64", "--height", "56", "-q")
    r = run(*args)
    assert r.returncode == 0, r.stderr
    files = [f for f in root.rglob("*") if f.is_file()]
    total = sum(f.stat().st_size for f in files)
    assert total >= 200_000
    assert f"{len(files)} files in 3 classes, {total / 1e6:.1f} MB, mean {total / len(files) / 1e3:.1f} KB" in r.stdout
    before = {f: f.stat().st_mtime_ns for f in files}
    r = run(*args)  # again: recognises the files, writes nothing
    assert r.returncode == 0, r.stderr
    assert f"{len(files)} files in 3 classes" in r.stdout
    assert {f: f.stat().st_mtime_ns for f in root.rglob("*") if f.is_file()} == before


def test_make_dataset_size_or_images(tmp_path):
    root = str(tmp_path / "ds")
    r = run("make-dataset", root, "--images", "4", "--size", "1MB")
    assert r.returncode == 2 and "not allowed with" in r.stderr
    r = run("make-dataset", root)
    assert r.returncode == 2 and "one of the arguments --images --size is required" in r.stderr
    r = run("make-dataset", root, "--size", "lots")
    assert r.returncode == 2 and "cannot parse size 'lots'" in r.stderr
    r = run("make-dataset", root, "--size", "1KB", "--classes", "10", "-q")  # 1 image > 1 KB
    assert r.returncode == 2 and "fewer than num_classes=10" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(root)


def test_cache_verify_disk_removes_damaged_entries_and_sets_the_ledger_to_what_the_folder_takes(tmp_path):
    import numpy as np

    from coordl.fetch import disk

    r = run("cache", "verify", "--disk", str(tmp_path))
    assert r.returncode == 0 and f"no coordl local-storage tier in {tmp_path}" in r.stdout
    tier = disk.DiskTier(disk.tier_folder(tmp_path))
    try:
        names = [f"s3://bucket/train/{k}.jpg" for k in range(20)]
        data = [np.full(3000 + k, k, dtype=np.uint8) for k in range(20)]
        tier.put(names, [disk.stamp(n, len(d), "e") for n, d in zip(names, data)], data)
        assert tier.flush(30) and tier.written == 20
        busy = run("cache", "verify", "--disk", str(tmp_path))
        assert busy.returncode == 1 and "a running process uses it" in busy.stdout
    finally:
        tier.close()
    folder = disk.tier_folder(tmp_path)
    damaged = os.path.join(folder, disk.entries.entry_name(names[3]))
    with open(damaged, "r+b") as f:  # a bit flipped in its bytes
        f.seek(disk.HEADER.itemsize + 10)
        byte = f.read(1)
        f.seek(disk.HEADER.itemsize + 10)
        f.write(bytes([byte[0] ^ 1]))
    with open(os.path.join(folder, "tmp", "7.999999.1"), "wb") as f:  # what a killed writer left
        f.write(b"half a sample")
    before = disk.describe(tmp_path)
    r = run("cache", "verify", "--disk", str(tmp_path))
    rel = disk.entries.entry_name(names[3])
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"removed {rel}: its bytes do not match their CRC-32" in r.stdout
    assert "19 entries whole" in r.stdout and "removed 1 file(s) that killed writers left in tmp/" in r.stdout
    du = subprocess.run(["du", "-s", "-B1", "-c", *sorted(glob.glob(os.path.join(folder, "??")))], capture_output=True)
    takes = int(du.stdout.split()[-2])
    assert f"the ledger counted {before.used} bytes; it counts {takes} bytes now" in r.stdout
    assert not os.path.exists(damaged) and os.listdir(os.path.join(folder, "tmp")) == []
    assert disk.describe(tmp_path).used == takes
    again = run("cache", "verify", "--disk", str(tmp_path))
    assert again.returncode == 0 and again.stdout.splitlines()[-1] == "the tier was clean", again.stdout
    ls = run("cache", "ls", "--disk", str(tmp_path))
    assert f"local-storage tier {folder}: " in ls.stdout and "budget auto" in ls.stdout

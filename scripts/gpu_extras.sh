#!/usr/bin/env bash
# Fetches, here (where a package registry is reachable), the wheels the GPU machine lacks beside the DALI kit of
# ../shared/gpu/pack.sh: Pillow and tqdm (coordl.tools.datagen makes the benchmark's JPEGs with them; the
# DataLoader baseline decodes with Pillow; tests/conftest.py imports PIL) and hypothesis with its pure-Python
# needs (many test modules import it, so `pytest -m gpu tests` cannot collect without it). cp312 manylinux
# wheels for the GPU machine's Python 3.12, into the git-ignored .gpu/extra/ (a few MB: they travel with the
# last DALI part). Run it after ../shared/gpu/pack.sh, which empties .gpu/. Then on the GPU machine:
# scripts/gpu_run.sh (see its header for the order of transfers).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
# .gpu/ must never travel as a plain untracked folder nor be committed: ignore it in this clone (a worktree's
# .git is a file, so ask git where its exclude file is).
exclude=$(git rev-parse --git-path info/exclude)
git check-ignore -q .gpu/extra/x.whl || { mkdir -p "$(dirname "$exclude")" && echo '/.gpu/' >> "$exclude"; }
rm -rf .gpu/extra && mkdir -p .gpu/extra
wheels=(pillow tqdm hypothesis)  # and what they need on that Python, resolved by pip
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/extra "${wheels[@]}" 2>&1 | grep -v "^WARNING: Location" || true
n=$(ls .gpu/extra/*.whl 2>/dev/null | wc -l)
[ "$n" -ge "${#wheels[@]}" ] || { echo "gpu_extras: got $n wheels of ${#wheels[@]}" >&2; exit 1; }
echo "gpu_extras: $n wheels, $(du -sh .gpu/extra | cut -f1), in .gpu/extra:"
ls .gpu/extra
# What travels in one transfer is at most 64 MiB: the tracked tree, the kit's last part and these wheels.
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
extra=$(du -cb .gpu/extra/*.whl | tail -1 | cut -f1)
last=$(ls -d .gpu/p[0-9]* 2>/dev/null | sort -V | tail -1 || true)
part_mb=$((((62 << 20) - tree - extra) >> 20))  # a part that fits beside them
if [ -n "$last" ]; then
  total=$((tree + extra + $(du -cb "$last" | tail -1 | cut -f1)))
  if [ "$total" -le $((62 << 20)) ]; then
    echo "gpu_extras: send .gpu/extra with $last ($((total >> 20)) MiB with the tree)"
  else
    echo "gpu_extras: $last, the tree and .gpu/extra make $((total >> 20)) MiB, over 64 MiB: pack again with" \
      "PART_MB=$part_mb bash ../shared/gpu/pack.sh, or send .gpu/extra alone first and run" \
      "mkdir -p /tmp/kit/extra && cp .gpu/extra/*.whl /tmp/kit/extra/ (scripts/gpu_run.sh looks there too)"
  fi
else
  echo "gpu_extras: .gpu/extra is $((extra >> 20)) MiB and the tree $((tree >> 20)) MiB; with pack.sh's parts of" \
    "52 MiB they may not fit beside the last one in 64 MiB: PART_MB=$part_mb bash ../shared/gpu/pack.sh"
fi

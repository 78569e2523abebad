"""Generate deterministic ImageNet-like ImageFolder datasets of JPEG files.

The generated tree is ``root/<class>/<class>_<i:06d><ext>`` with ImageNet-style
class folder names (``n00000000``, ``n00000001``, ...), images spread
round-robin over the classes. Image sizes, resolutions and compressed bytes per
pixel resemble ImageNet's (about 400x350 pixels and 0.8 bytes/pixel at JPEG
quality 90), so the files are realistic inputs for data-loading benchmarks and
tests.

A dataset is sized either by its number of images (``num_images``) or by its
total size in bytes (``total_bytes``): then it holds images ``0..n-1`` for the
smallest ``n`` whose files add up to at least ``total_bytes``. ``n`` is found
in rounds (estimate the mean file size from the files known so far, generate
about as many images as are still missing, repeat), and any images generated
past ``n`` are deleted again, so the result is as deterministic as with
``num_images``.

Two sources of content:

* ``photos_dir`` given: random crops of natural photographs (random scale,
  aspect ratio and horizontal flip), resized to the target size, plus
  gaussian sensor grain.
* no ``photos_dir``: synthetic images made of smooth random colour fields,
  gradients, random shapes and multi-scale texture, plus grain.

Every image is a pure function of ``(seed, index)`` and the generation
arguments: each has its own random generator (``numpy.random.default_rng([seed,
index])``), so images can be produced in any order, in parallel, and still be
byte-identical from run to run. Files are written atomically (temporary name in
the same folder, then :func:`os.replace`), and each JPEG carries a comment that
identifies the arguments it was made with, so a second call with the same
arguments can recognise the existing files cheaply and return without
regenerating them.

Example:
    >>> from coordl.tools.datagen import make_dataset
    >>> summary = make_dataset("/tmp/fake-imagenet", num_images=2000)  # doctest: +SKIP
    >>> print(summary)  # doctest: +SKIP
    2000 files in 10 classes, 221.4 MB, mean 110.7 KB, 0.79 bytes/pixel at /tmp/fake-imagenet
    >>> summary = make_dataset("/tmp/fake-imagenet-1g", total_bytes=10**9)  # doctest: +SKIP
    >>> summary.total_bytes >= 10**9  # doctest: +SKIP
    True

How the modules fit together: :mod:`.dataset` holds the API and the job's bookkeeping (checks
the arguments, sizes the dataset in rounds, builds the summary); :mod:`.scan` recognises the
files already there; :mod:`.job` says what image ``i`` is and writes it atomically;
:mod:`.images` draws its pixels, from photographs or from noise; :mod:`.workers` writes many
images in a pool of processes. Imports point one way: :mod:`.dataset` uses the other four,
:mod:`.scan` and :mod:`.workers` use :mod:`.job` and :mod:`.images`, and :mod:`.job` uses
:mod:`.images`.
:mod:`.coco`, imported on its own, writes small COCO detection sets of coloured boxes (with :mod:`.images`).
"""

from coordl.tools.datagen.dataset import DatasetSummary, make_dataset

__all__ = ["DatasetSummary", "make_dataset"]

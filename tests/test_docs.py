"""The documentation stays true: its code runs, its tables match the code, its links resolve.

Conventions in the Markdown (docs/*.md and README.md):

- Every ```python block must compile, and every ``coordl.X`` it names must exist.
- A block preceded by ``<!-- doctest: run -->`` is executed, in a temporary folder, with the
  example dataset paths (``/data/imagenet/train``, ``/tmp/demo/train``, ...) replaced by a tiny
  generated dataset. Write such blocks so that they run as they are on a CPU.
- A ```diff block preceded by ``<!-- doctest: run-diff args="{data} ..." -->`` holds a whole
  script before and after a change: both sides must compile, and the "after" side is run as
  ``__main__`` with those command-line arguments (``{data}``: the tiny dataset).
- An executed block checks what it claims: with its own ``assert`` where one reads naturally in a
  user's code; a ``print(...)  # text`` line must print that text; and ``CLAIMS`` below checks
  the rest of what the page says the block does, from what it printed, the names it left and the
  batches its loops received.
- docs/configuration.md has a table row per ``CoordLoader`` argument, option object field
  (``coordl.Cache``, ``Peers``, ...), recipe field and environment variable, with the default as
  a Python literal in backticks (``required`` for a field without one).
- docs/faq.md quotes, in backticks, every message coordl raises, warns or logs at warning level
  or above: all of its literal text, in order, with the variable parts written ``<like this>``.
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import hashlib
import importlib
import inspect
import json
import math
import re
import shlex
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import coordl
import coordl.errors
from coordl.passes import Pass

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "coordl"
PAGES = sorted(DOCS.glob("*.md"))
MARKDOWN = PAGES + [ROOT / "README.md"]

# Paths the docs use for a dataset; executed blocks get the tiny test dataset instead.
DATA_PATHS = ("/data/imagenet/train", "/data/imagenet/val", "/tmp/demo/train", "/tmp/demo/val", "/tmp/docs-ds")

# Pages whose key snippets must be executed (the issue: the quick start's first loop, the
# migration guide's "after" code, resume, statistics, recipes), and how many at least.
MUST_RUN = {"quickstart.md": 1, "migration.md": 1, "guarantees.md": 2, "user-guide.md": 2, "configuration.md": 1}


# -- reading the Markdown ------------------------------------------------------------------
@dataclasses.dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    directive: str  # the `<!-- doctest: ... -->` before the block, or ""

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, k = [], 0
    while k < len(lines):
        m = re.match(r"^(\s*)```(\S*)", lines[k])
        if not m:
            k += 1
            continue
        indent, lang, start = len(m.group(1)), m.group(2), k
        body = []
        k += 1
        while k < len(lines) and not re.match(r"^\s*```\s*$", lines[k]):
            body.append(lines[k][indent:] if lines[k][:indent].strip() == "" else lines[k])
            k += 1
        prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        directive = re.fullmatch(r"<!--\s*doctest:\s*(.*?)\s*-->", prev)
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n", directive.group(1) if directive else ""))
        k += 1
    return blocks


BLOCKS = [b for p in MARKDOWN for b in code_blocks(p)]
PYTHON = [b for b in BLOCKS if b.lang in ("python", "py")]
DIFFS = [b for b in BLOCKS if b.directive.startswith("run-diff")]
RUN = [b for b in BLOCKS if b.directive == "run" or b.directive.startswith("run-diff")]


def diff_sides(code: str) -> tuple[str, str]:
    """The before and after files of a unified diff that shows them whole."""
    before, after, started = [], [], False
    for line in code.splitlines():
        if line.startswith("@@"):
            started = True
            continue
        if not started:
            continue  # the --- / +++ header
        tag, text = (line[:1], line[1:]) if line else (" ", "")
        if tag in (" ", "-"):
            before.append(text)
        if tag in (" ", "+"):
            after.append(text)
    return "\n".join(before) + "\n", "\n".join(after) + "\n"


def python_sources() -> list[tuple[str, str]]:
    out = [(b.id, b.code) for b in PYTHON]
    for b in DIFFS:
        before, after = diff_sides(b.code)
        out += [(f"{b.id} (before)", before), (f"{b.id} (after)", after)]
    return out


def section(text: str, heading: str) -> str:
    """The text under a ``## heading`` up to the next heading of the same or a higher level."""
    m = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert m, f"no heading {heading!r}"
    level = len(m.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[m.end() :], re.M)
    return text[m.end() : m.end() + end.start()] if end else text[m.end() :]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every table row in ``text`` (header and separator rows left out)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or re.fullmatch(r"\|[-|: ]+\|", line.strip()):
            continue
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return [r for r in rows if r and r[0] not in ("Argument", "Field", "Variable", "Message", "Value", "File")]


def code_span(cell: str) -> str | None:
    m = re.fullmatch(r"`([^`]+)`", cell)
    return m.group(1) if m else None


# -- python blocks -------------------------------------------------------------------------
@pytest.mark.parametrize("name,code", python_sources(), ids=[n for n, _ in python_sources()])
def test_python_blocks_compile(name, code):
    compile(code, name, "exec")


def _coordl_names(code: str) -> set[str]:
    names = set(re.findall(r"\bcoordl((?:\.[A-Za-z_]\w*)+)", code))
    for mod, imported in re.findall(r"^\s*from coordl((?:\.\w+)*) import ([\w, ()]+)", code, re.M):
        names |= {f"{mod}.{n.strip()}" for n in imported.strip("()").split(",") if n.strip()}
    return names


def _resolve(dotted: str):
    obj, path = coordl, "coordl"
    for part in dotted.strip(".").split("."):
        path = f"{path}.{part}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(path)  # a submodule not imported yet
    return obj


@pytest.mark.parametrize("name,code", python_sources(), ids=[n for n, _ in python_sources()])
def test_every_coordl_name_exists(name, code):
    for dotted in sorted(_coordl_names(code)):
        try:
            _resolve(dotted)
        except (AttributeError, ImportError) as e:
            pytest.fail(f"{name}: coordl{dotted} does not exist ({e})")


def test_the_key_snippets_are_executed():
    counts = {}
    for b in RUN:
        counts[b.path.name] = counts.get(b.path.name, 0) + 1
    for page, at_least in MUST_RUN.items():
        assert counts.get(page, 0) >= at_least, f"{page}: {counts.get(page, 0)} executed blocks, want {at_least}"


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch a training loop received: its epoch, its images' shape, dtype, device and digest, and its
    labels."""

    epoch: int
    shape: tuple
    dtype: torch.dtype
    device: str
    digest: str
    labels: tuple


class Received:
    """Every ``CoordLoader`` a block makes (its arguments) and the batches its loops receive from it, taken
    where the loop receives them (``Pass.__next__``). The loaders are coordl's own; this only records."""

    def __init__(self, monkeypatch):
        self.loaders: list[tuple[tuple, dict, list[Batch]]] = []  # (args, kwargs, batches) per loader made
        made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        init, iterate, step = coordl.CoordLoader.__init__, coordl.CoordLoader.__iter__, Pass.__next__

        def __init__(loader, *args, **kwargs):
            init(loader, *args, **kwargs)
            made[loader] = []
            self.loaders.append((args, kwargs, made[loader]))

        def __iter__(loader):
            p = iterate(loader)
            p._received_by_doc = made.get(loader)
            return p

        def __next__(p):
            out = step(p)
            if getattr(p, "_received_by_doc", None) is not None:
                p._received_by_doc.append(batch_of(p.epoch, out))
            return out

        monkeypatch.setattr(coordl.CoordLoader, "__init__", __init__)
        monkeypatch.setattr(coordl.CoordLoader, "__iter__", __iter__)
        monkeypatch.setattr(Pass, "__next__", __next__)


def batch_of(epoch: int, out) -> Batch:
    images, labels = out[0], out[1]
    digest = hashlib.sha1(images.cpu().contiguous().numpy().tobytes()).hexdigest()
    if isinstance(labels, list):  # a detection batch's targets: each sample's labels
        labels = tuple(tuple(t["labels"].tolist()) for t in labels)
    else:
        labels = tuple(labels.tolist())
    return Batch(epoch, tuple(images.shape), images.dtype, images.device.type, digest, labels)


@dataclasses.dataclass
class Run:
    """What an executed block did: its lines of output by the line of the ``print`` that wrote them, the
    names it left, the loaders it made and what they delivered, the dataset and the folder it ran in."""

    printed: list[tuple[int, str]]
    names: dict
    received: Received
    data: Path
    folder: Path

    def lines(self) -> list[str]:
        return [text for _, text in self.printed]


def printing(printed: list[tuple[int, str]]):
    """A ``print`` for a block's globals: prints, and records each line with the block's line that wrote it."""

    def print_(*args, sep=" ", end="\n", **kwargs):
        text = sep.join(map(str, args))
        printed.append((sys._getframe(1).f_lineno, text))
        print(text, end=end, **kwargs)

    return print_


def expected_prints(code: str) -> dict[int, str]:
    """``{line: text}`` for each one-line ``print(...)  # text`` of a block."""
    return {
        n: m.group(1)
        for n, line in enumerate(code.splitlines(), 1)
        if (m := re.fullmatch(r"\s*print\(.*\)\s*#\s*(.+?)\s*", line))
    }


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_runnable_blocks_run(block, tiny_dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = str(tiny_dataset)
    if block.directive.startswith("run-diff"):
        m = re.fullmatch(r'run-diff\s+args="([^"]*)"', block.directive)
        assert m, f'{block.id}: write <!-- doctest: run-diff args="{{data}} ..." -->'
        code = diff_sides(block.code)[1]
        monkeypatch.setattr(sys, "argv", ["train.py", *shlex.split(m.group(1).format(data=data))])
        name = "__main__"
    else:
        code, name = block.code, "__doc_block__"
    for path in DATA_PATHS:
        code = code.replace(path, data)
    printed: list[tuple[int, str]] = []
    namespace = {"__name__": name, "print": printing(printed)}
    received = Received(monkeypatch)
    try:
        # dont_inherit: the block runs as a user's script, without this file's `from __future__ import annotations`
        # (under which a dataclass defined in a block looks for a module that is not in sys.modules)
        exec(compile(code, block.id, "exec", dont_inherit=True), namespace)
        for line, text in expected_prints(code).items():
            got = [out for n, out in printed if n == line]
            assert got == [text], f"{block.id}: line {line} of the block printed {got}, its comment says {text!r}"
        check = claims_of(block)
        if check is not None:
            check(Run(printed, namespace, received, tiny_dataset, tmp_path))
    finally:
        namespace.clear()
        gc.collect()  # loaders a block did not close are closed here, before the leak check


# -- what the executed blocks claim --------------------------------------------------------
def _dataset_bytes(data: Path) -> int:
    return sum(p.stat().st_size for p in data.rglob("*.jpg"))


def _samples(run: Run) -> int:
    return len(list(run.data.rglob("*.jpg")))


def _loader_options(run: Run) -> None:
    # configuration.md: the option objects and shorthands; rank 0 of 2 gets half of each epoch.
    loader, images = run.names["loader"], run.names["images"]
    assert len(loader) == math.ceil(math.ceil(len(loader.index) / 2) / 16), "not one shard of 2"
    assert tuple(images.shape) == (16, 3, 224, 224) and images.dtype == torch.float32


def _decoded_tier(run: Run) -> None:
    # decoded-tier.md: a DecodedRecipe's epoch decodes the images into the tier (all: 64 MB hold them).
    (line,) = run.lines()
    assert line == f"{_samples(run)} images decoded into the tier", line


def _resume(run: Run) -> None:
    # guarantees.md: after a state saved when the loop had received batches 0, 1 and 2, the resumed loader
    # delivers batch 3 onwards of epoch 0, then whole epochs: the batches the uninterrupted run delivers.
    (args, kwargs, before), (args2, kwargs2, after) = run.received.loaders
    assert (args, kwargs) == (args2, kwargs2), "the example resumes the same loader"
    state = json.loads((run.folder / "loader-state.json").read_text())
    assert (state["epoch"], state["batches"]) == (0, 3), state
    with coordl.CoordLoader(*args, **kwargs) as loader:  # the uninterrupted run
        for epoch in range(3):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
    whole = run.received.loaders[2][2]
    assert [b.epoch for b in whole] == [e for e in range(3) for _ in range(len(loader))]
    assert before == whole[:3], "the first 3 batches differ from the uninterrupted run's"
    assert after == whole[3:], (
        f"the resumed run delivered {len(after)} batches, the uninterrupted run {len(whole) - 3} from batch 3 on; "
        f"first difference at {next((k for k, (a, b) in enumerate(zip(after, whole[3:])) if a != b), None)}"
    )


def _migration(run: Run) -> None:
    # migration.md: the new script trains 1 epoch, says how long it waited, saves a checkpoint; the batches
    # have the shapes and types of torchvision's: (B, 3, 224, 224) float32 images, int64 labels.
    (line,) = run.lines()
    assert re.fullmatch(r"epoch 0: waited \d+\.\d s for data", line), line
    checkpoint = torch.load(run.folder / "checkpoint.pt", map_location="cpu")
    assert checkpoint["epoch"] == 1 and checkpoint["model"] and checkpoint["optimizer"]
    ((_, _, batches),) = run.received.loaders
    assert sum(len(b.labels) for b in batches) == _samples(run) and all(b.epoch == 0 for b in batches)
    assert all(b.shape[1:] == (3, 224, 224) and b.dtype == torch.float32 for b in batches)


STATS_LINE = (
    r"epoch (\d+): (\d+) samples in [\d.]+ s, waited [\d.]+ s \(fetch [\d.]+ s, prep [\d.]+ s\); "
    r"(\d+) cache hits, (\d+) storage reads, (\d+) samples cached"
)


def _half_cached(run: Run, hits: list[int], reads: list[int], cached: int) -> None:
    """Epoch 0 reads every sample from storage and admits half the bytes; epoch 1 hits the cached samples
    and reads only the rest (a steady epoch: storage_bytes == dataset bytes - cache_bytes)."""
    n, total, s = _samples(run), _dataset_bytes(run.data), run.names["s"]
    assert (hits[0], reads[0]) == (0, n), (hits, reads)
    assert hits[1] == cached > 0 and reads[1] == n - cached, (hits, reads, cached)
    assert s["cache_budget"] == total // 2 and s["cache_bytes"] <= s["cache_budget"], s
    assert s["storage_bytes"] == total - s["cache_bytes"], s
    biggest = max(p.stat().st_size for p in run.data.rglob("*.jpg"))
    assert s["cache_bytes"] > s["cache_budget"] - biggest, "the cache was not filled up to its budget"


def _statistics(run: Run) -> None:
    # user-guide.md: the statistics of two epochs with cache=0.5.
    got = [re.fullmatch(STATS_LINE, line) for line in run.lines()]
    assert len(got) == 2 and all(got), run.lines()
    epochs, samples, hits, reads, cached = ([int(m.group(k)) for m in got] for k in range(1, 6))
    assert epochs == [0, 1] and samples == [_samples(run)] * 2, (epochs, samples)
    _half_cached(run, hits, reads, cached[1])


def _quickstart(run: Run) -> None:
    # quickstart.md: two epochs of (64, 3, 112, 112) float32 batches on the device, reshuffled; cache=0.5
    # keeps half of the bytes, so the second epoch reads only the rest from storage.
    ((_, _, batches),) = run.received.loaders
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = _samples(run)
    sizes = [64] * (n // 64) + [n % 64] * (n % 64 > 0)
    assert [(b.epoch, b.shape[0]) for b in batches] == [(e, size) for e in (0, 1) for size in sizes]
    assert all(b.shape[1:] == (3, 112, 112) and b.dtype == torch.float32 and b.device == device for b in batches)
    orders = [[label for b in batches if b.epoch == e for label in b.labels] for e in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) and orders[0] != orders[1], "epoch 1 is not reshuffled"
    line = r"epoch (\d): loss \d+\.\d\d, \d+ samples/s, (\d+) cache hits, (\d+) storage reads"
    got = [re.fullmatch(line, text) for text in run.lines()]
    assert len(got) == 2 and all(got), run.lines()
    hits, reads = [int(m.group(2)) for m in got], [int(m.group(3)) for m in got]
    _half_cached(run, hits, reads, run.names["s"]["cache_items"])


def _custom_recipe(run: Run) -> None:
    # user-guide.md: torch.Size([16, 3, 128, 128]) float32 in [-1, 1]
    images = run.names["images"]
    assert tuple(images.shape) == (16, 3, 128, 128) and images.dtype == torch.float32
    assert -1.0 <= images.min() and images.max() <= 1.0 and images.min() < 0 < images.max()


# (page, a phrase of the block) -> what the page says the block does. A block that asserts its claims
# itself, or whose only claim is what a commented print prints, needs no entry.
CLAIMS: dict[tuple[str, str], Callable[[Run], None]] = {
    ("configuration.md", "fetch=coordl.Fetch(batches_ahead=4)"): _loader_options,
    ("decoded-tier.md", "images decoded into the tier"): _decoded_tier,
    ("guarantees.md", "loader.load_state_dict("): _resume,
    ("migration.md", "waited {loader.stats()"): _migration,
    ("user-guide.md", "samples cached"): _statistics,
    ("quickstart.md", "optimizer.step()"): _quickstart,
    ("user-guide.md", "def flip_and_crop"): _custom_recipe,
}


def claims_of(block: Block) -> Callable[[Run], None] | None:
    found = [check for (page, phrase), check in CLAIMS.items() if page == block.path.name and phrase in block.code]
    assert len(found) <= 1, f"{block.id}: {len(found)} CLAIMS entries"
    return found[0] if found else None


def test_every_executed_block_checks_what_it_claims():
    unchecked = [
        b.id
        for b in RUN
        if claims_of(b) is None and not expected_prints(b.code) and not re.search(r"^\s*assert ", b.code, re.M)
    ]
    assert not unchecked, f"executed blocks that check nothing (add an assert, a print comment, CLAIMS): {unchecked}"
    for page, phrase in CLAIMS:
        assert sum(b.path.name == page and phrase in b.code for b in RUN) == 1, (page, phrase)


# -- configuration.md ----------------------------------------------------------------------
CONFIG = (DOCS / "configuration.md").read_text()


def _literal(text: str):
    return eval(text, {"__builtins__": {}}, {})  # our own docs' literals, with no builtins


def _documented(rows: list[list[str]]) -> dict[str, str]:
    out = {}
    for row in rows:
        name = code_span(row[0])
        if name is not None and re.fullmatch(r"\w+", name):
            assert name not in out, f"{name} is documented twice"
            out[name] = row[1]
    return out


def _check_defaults(documented: dict[str, str], params: dict[str, object], what: str) -> None:
    missing = sorted(set(params) - set(documented))
    extra = sorted(set(documented) - set(params))
    assert not missing, f"{what}: not documented: {missing}"
    assert not extra, f"{what}: documented but not in the code: {extra}"
    for name, default in params.items():
        cell = documented[name]
        if default is inspect.Parameter.empty:
            assert cell == "required", f"{what}: {name} has no default; write 'required', not {cell!r}"
            continue
        literal = code_span(cell)
        assert literal is not None, f"{what}: write {name}'s default as a literal in backticks, not {cell!r}"
        value = _literal(literal)
        assert value == default and type(value) is type(default), (
            f"{what}: {name} defaults to {default!r} in the code, {literal} in configuration.md"
        )


def test_configuration_documents_every_argument_with_its_default():
    params = {n: p.default for n, p in inspect.signature(coordl.CoordLoader.__init__).parameters.items() if n != "self"}
    documented = _documented(table_rows(section(CONFIG, "CoordLoader arguments")))
    _check_defaults(documented, params, "CoordLoader")


def _fields_table(heading: str, cls) -> dict[str, str]:
    """The rows of the table that follows ``**`coordl.<cls>`**`` under ``## heading``."""
    text = section(CONFIG, heading)
    start = text.index(f"**`coordl.{cls.__name__}`**")
    return _documented(table_rows(text[start:].split("\n\n**")[0]))


def _field_defaults(cls) -> dict[str, object]:
    return {
        f.name: inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        for f in dataclasses.fields(cls)
        if f.init
    }


@pytest.mark.parametrize(
    "cls",
    [coordl.ImageNetTrain, coordl.ImageNetVal, coordl.SSDTrain, coordl.SSDVal, coordl.AudioTrain, coordl.AudioVal],
    ids=lambda c: c.__name__,
)
def test_configuration_documents_every_recipe_field_with_its_default(cls):
    _check_defaults(_fields_table("Recipes", cls), _field_defaults(cls), cls.__name__)


OPTIONS = [coordl.Cache, coordl.Peers, coordl.HPGroup, coordl.Shard, coordl.Prep, coordl.RayPrep, coordl.Fetch]
#: The option objects one argument takes besides its own (``prep`` takes a Prep or a RayPrep).
ALSO = {coordl.RayPrep: "prep"}


@pytest.mark.parametrize("cls", OPTIONS, ids=lambda c: c.__name__)
def test_configuration_documents_every_option_field_with_its_default(cls):
    _check_defaults(_fields_table("Option objects", cls), _field_defaults(cls), cls.__name__)


def test_configuration_documents_every_disk_field_with_its_default():
    _check_defaults(_fields_table("Option objects", coordl.Disk), _field_defaults(coordl.Disk), "Disk")


def test_every_option_object_is_documented():
    """A new option object of the loader gets a table too (``loader.options`` holds them all)."""
    from coordl.options import Options

    held = {f.name for f in dataclasses.fields(Options)}
    named = {coordl.HPGroup: "hp_group", **ALSO}
    documented = {named.get(cls, cls.__name__.lower()) for cls in OPTIONS}
    assert held == documented, (sorted(held), sorted(documented))


def _environment_variables() -> set[str]:
    """Every environment variable the library reads, from its source."""
    found = set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        consts = {
            t.id: n.value.value
            for n in tree.body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
        }
        for node in ast.walk(tree):
            key = None
            if isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                readers = ("os.environ.get", "os.getenv", "env.text", "env.flag", "env.integer", "env.number")
                if func in readers and node.args:
                    key = node.args[0]
                elif func == "dict" and node.args and ast.unparse(node.args[0]) == "os.environ":
                    found |= {k.arg for k in node.keywords if k.arg}
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
                key = node.slice
            if isinstance(key, ast.Constant):
                found.add(key.value)
            elif isinstance(key, ast.Name) and key.id in consts:
                found.add(consts[key.id])  # a parameter (e.g. env_int's name) is found at the callers
    return found


def test_configuration_documents_every_environment_variable():
    documented = set()
    for row in table_rows(section(CONFIG, "Environment variables")):
        documented |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", row[0]))
    read = _environment_variables()
    assert read, "found no environment variable in the source"
    assert not read - documented, f"read by coordl, not in configuration.md: {sorted(read - documented)}"
    assert not documented - read, f"in configuration.md, not read by coordl: {sorted(documented - read)}"


# Figures the docs state that come from constants in the code: (value in the code, expected,
# a page, the phrase on it). If the code changes, the sentence must change with it.
def _facts():
    from coordl.fetch import cache, chunks, peer_server, wire
    from coordl.shm import limits
    from coordl.staging import grouppass, layout

    return [
        (cache.ENTRY.itemsize, 16, "shm.md", "16 bytes per sample"),
        (cache.HEADER_BYTES, 128, "configuration.md", "128 bytes plus 16 per sample"),
        (cache.HEADER_BYTES + 16 * 1_281_167, 20_498_800, "configuration.md", "20.5 MB for 1,281,167 samples"),
        (cache.DEFAULT_CHUNK_BYTES, 64 << 20, "shm.md", "chunks of 64 MiB"),
        (chunks.headroom(1 << 40), 1 << 30, "shm.md", "at most 1 GiB"),
        (chunks.headroom(1), 64 << 20, "shm.md", "at least 64 MiB"),
        (chunks.headroom(10 << 30), 1 << 30, "shm.md", "10% of the filesystem's size"),
        (cache.DEFAULT_SLICE_BYTES, 8 << 20, "shm.md", "8 MiB at a time"),
        (limits.margin(1 << 30), 256 << 20, "shm.md", "at least 256 MiB"),
        (limits.margin(10 << 30), 1 << 30, "shm.md", "10% of the limit"),
        (layout.CONTROL_BYTES, 16 << 10, "configuration.md", "a 16 KiB control file"),
        (layout.MIN_SLOTS, 4, "configuration.md", "never fewer than 4"),
        (layout.MAX_SLOTS, 64, "configuration.md", "At most 64 slots"),
        (layout.MAX_MEMBERS, 64, "faq.md", "already has 64 members"),
        (layout.DEFAULT_UNIT_MAX, 256, "configuration.md", "doubled while the double is at most 256"),
        (layout.DEFAULT_UNITS_PER_PASS, 8, "configuration.md", "at most an eighth of the rank's epoch"),
        (layout.AUTO_SLOTS, 16, "configuration.md", "16 slots of it fit in `staging`"),
        (grouppass.PROGRESS_EVERY_S, 30.0, "faq.md", "Repeated every 30 s"),
        (peer_server.MAX_CONNECTIONS, 256, "configuration.md", "(at most 256)"),
        (wire.HANDSHAKE_TIMEOUT, 5.0, "multinode.md", "within 5 s"),
        (3 * 224 * 224 * 4, 602_112, "configuration.md", "602,112 bytes"),
    ]


def test_figures_taken_from_the_code_are_current():
    for value, expected, page, phrase in _facts():
        assert value == expected, f"the code now says {value}, {page} says {phrase!r}"
        assert phrase in " ".join((DOCS / page).read_text().split()), f"{page} no longer says {phrase!r}"


# -- faq.md: every message -------------------------------------------------------------------
# Messages users never see, and raises whose text is made elsewhere. Each entry: (file under
# src/coordl, a piece of the message or of the raised expression), and why.
NOT_FOR_USERS = [
    ("__init__.py", "has no attribute"),  # Python's module __getattr__ protocol
    ("tools/datagen/workers.py", "worker job not initialised"),  # unreachable: the pool initializer sets it
    ("tools/datagen/audiocodec.py", "not an Ogg page"),  # libsndfile's own output: a malformed page is a bug
    ("placement.py", ""),  # input checks of pure planning functions; the loader passes valid plans
    ("sampler.py", "rank must be in"),  # the same for the sampler; the loader checks the rank first
    ("shm/group.py", "already joined"),  # a programming error inside coordl
    ("shm/names.py", ""),  # segment names are made by coordl itself
    ("backends/torch.py", "fetches whole batches"),  # DataLoader always calls __getitems__
    ("backends/torch.py", "failure_error("),  # re-raises a worker's SampleError, listed in faq.md
    ("staging/grouppass.py", "taken.error"),  # re-raises a staged SampleError, listed in faq.md
    ("backends/torch.py", "DatasetChangedError(message)"),  # a worker's failure again, listed in faq.md
    ("backends/torch.py", "SampleError(message, path=path, index=i)"),  # likewise
    ("analyze/probe.py", "SystemExit"),  # ends an analysed script with status 0; no message
    ("errors.py", "warnings.warn(message"),  # errors.warn() itself; its callers' messages are scanned
    ("compat.py", "_missing("),  # a CompatError made by _missing(), whose message is scanned there
    ("analyze/probe.py", "next(iter(failed.values()))"),  # a sample's read error, listed in faq.md
    ("s3/client.py", "classify("),  # a store's refusal as coordl's error, each listed in faq.md
    ("s3/listing.py", "_cannot_list("),  # likewise, for a listing
    ("s3/reads.py", "_changed_size("),  # storage.py's message for a changed size, listed in faq.md
    ("threads.py", ""),  # thread primitives used by coordl only: a pool misused is a bug in coordl
    ("remote/raypass.py", "failure_error("),  # an actor's SampleError again, listed in faq.md
    ("s3/reads.py", "_short_range("),  # a range GET that came back short: its message is scanned there
    ("tars/format.py", "client.explain("),  # a store's answer to an index's GET, each listed in faq.md
    ("tars/scan.py", "cls(value)"),  # a worker process's ShardError or OSError again, listed in faq.md
    ("tars/format.py", "a streaming read went back"),  # the header loop only reads forward: a bug in coordl
    ("tars/scan.py", "str(e).replace("),  # listing's "sample <url> does not exist" as "shard <url> ..."
]
LOG_LEVELS = {"warning", "error", "exception", "critical"}
COORDL_ERRORS = set(coordl.errors.__all__) | {"CompatError"}  # coordl.compat's, a CoordlError
PLACEHOLDER = "\x00"


def _template(node, assigned: dict, functions: dict) -> str | None:
    """The text of a message expression, with PLACEHOLDER for its variable parts."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else PLACEHOLDER for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _template(node.left, assigned, functions), _template(node.right, assigned, functions)
        return (left or PLACEHOLDER) + (right or PLACEHOLDER) if left or right else None
    if isinstance(node, ast.Name) and node.id in assigned:
        return _template(assigned[node.id], assigned, functions)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
        returns = [n.value for n in ast.walk(functions[node.func.id]) if isinstance(n, ast.Return) and n.value]
        return _template(returns[0], assigned, functions) if returns else None
    return None


def _messages() -> list[tuple[str, int, str, str]]:
    """``(file, line, the raised or logged expression, template)`` of every message in the source."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        tree = ast.parse(path.read_text())
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        # A message kept in a module-level constant (``raise ValueError(PIPELINE_NEEDED)``).
        constants = {
            t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
        }
        seen = set()
        for scope in reversed(scopes):  # innermost functions first; each node is taken once
            assigned = constants | {
                t.id: n.value
                for n in ast.walk(scope)
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            for node in ast.walk(scope):
                if id(node) in seen:
                    continue
                arg = None
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                    args = node.exc.args
                    arg = args[1] if ast.unparse(node.exc.func) == "OSError" and len(args) > 1 else args[0]
                    seen.add(id(node.exc))
                elif isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in COORDL_ERRORS:
                    arg = node.args[0]  # made here, raised elsewhere (a batch's read failures)
                elif isinstance(node, ast.Call) and node.args:
                    func = node.func
                    if ast.unparse(func) == "warnings.warn" or (
                        isinstance(func, ast.Attribute)
                        and func.attr in LOG_LEVELS
                        and ast.unparse(func.value) in ("log", "logger", "logging")
                    ):
                        arg = node.args[0]
                if arg is None:
                    continue
                seen.add(id(node))
                expr = ast.unparse(node.exc if isinstance(node, ast.Raise) else node)
                out.append((rel, node.lineno, expr, _template(arg, assigned, functions)))
    return out


def _normal(text: str) -> str:
    return " ".join(text.split())


def _runs(template: str) -> list[str]:
    text = re.sub(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfgixX]", PLACEHOLDER, template)
    return [r for r in (_normal(p).strip(" ,;:.") for p in text.split(PLACEHOLDER)) if len(r) >= 3]


def _allowed(rel: str, expr: str, template: str | None) -> bool:
    return any(rel == f and (piece in expr or (template and piece in template)) for f, piece in NOT_FOR_USERS)


MESSAGES = _messages()


def test_the_message_scan_finds_the_messages():
    assert len(MESSAGES) > 100
    assert any("cannot read sample" in (t or "") for *_, t in MESSAGES)  # f-string raises
    assert any("replacing stale cache state" in (t or "") for *_, t in MESSAGES)  # %-style log calls
    assert any("stopped growing" in (t or "") for *_, t in MESSAGES)  # warnings.warn
    assert any("was started by a job with a different" in (t or "") for *_, t in MESSAGES)  # via a helper


def test_faq_quotes_every_message():
    faq = _normal((DOCS / "faq.md").read_text())
    missing = []
    for rel, line, expr, template in MESSAGES:
        if _allowed(rel, expr, template):
            continue
        runs = _runs(template or "")
        if not runs:
            missing.append(f"{rel}:{line}: no text of its own ({expr}); quote it in faq.md or allow-list it")
            continue
        # Every literal piece of the message, in order, with only placeholders between them.
        if re.search(".{0,200}?".join(map(re.escape, runs)), faq) is None:
            missing.append(f"{rel}:{line}: {' ... '.join(runs)!r}")
    assert not missing, "faq.md lacks these messages:\n" + "\n".join(missing)


def test_the_allow_list_has_no_stale_entries():
    for f, piece in NOT_FOR_USERS:
        assert any(rel == f and (piece in expr or piece in (t or "")) for rel, _, expr, t in MESSAGES), (f, piece)


# -- links ---------------------------------------------------------------------------------
def slug(heading: str) -> str:
    """GitHub's anchor for a heading (MkDocs' toc makes the same for the headings used here)."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    text_wo_code = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    found = {slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text_wo_code, re.M)}
    return found | set(re.findall(r'<a (?:id|name)="([^"]+)"', text))


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    in_code = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if re.match(r"^\s*```", line):
            in_code = not in_code
            continue
        if in_code:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        out += [(n, t) for t in re.findall(r"\]\(([^)\s]+)\)", line)]
    return out


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: p.name)
def test_links_resolve(page):
    broken = []
    for n, target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{page.name}:{n}: {target} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.name}:{n}: {target} (no such anchor)")
    assert not broken, "\n".join(broken)


def test_the_index_and_the_mkdocs_nav_list_every_page():
    index = (DOCS / "index.md").read_text()
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES:
        assert re.search(rf"\]\({re.escape(page.name)}(#[^)]*)?\)", index) or page.name == "index.md", page.name
        assert re.search(rf":\s*{re.escape(page.name)}\s*$", nav, re.M), f"mkdocs.yml's nav lacks {page.name}"


def test_mkdocs_builds_strictly(tmp_path):
    import mkdocs  # noqa: F401  (the test extra installs the docs extra)

    # (not -q: mkdocs then drops the warnings that --strict counts)
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr

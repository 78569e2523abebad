"""Successive halving on one ``hp_group``: after every epoch the worst trial is killed and a new one starts.

Starts ``--trials`` trials of ``train.py`` with learning rates drawn log-uniformly (seeded), all
naming one ``hp_group``, as an HP-search tool starts them: ordinary, independent processes.

A *round* ends when every trial still training has finished one more epoch (a newcomer that has
not finished its first epoch yet does not hold the others up). The trials are then ranked by their
mean training loss at the same number of epochs, the fewest that any of them has done, so that a
trial started later is compared with the others' loss after as many epochs as it has had. The
worst one is killed with SIGKILL, as HP tools stop a trial, and a new trial with a new learning
rate starts and joins the running group (at the group's next epoch, when it arrives in the middle
of one). After ``--rounds`` rounds the survivors finish their epochs, and a summary shows, per
trial, how many of its batches other trials made: the group kept sharing after every kill, and
the newcomers joined it.

    python examples/hpsearch/halving.py --demo
    python examples/hpsearch/halving.py /path/to/train --trials 4 --rounds 3 --epochs 8

Exits with 1 if a trial that was not killed failed, or ``--timeout`` passed. Every trial runs in
a process group of its own: a kill reaches whatever it started. On Ctrl-C, SIGTERM, an error or a
timeout, the trials still running are interrupted (so that they leave the group, which removes
its shared memory), and those that do not stop within 10 s are killed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

import common  # noqa: E402 - this folder's module (the script's folder is on sys.path)

T0 = time.monotonic()
_print_lock = threading.Lock()


def say(line: str) -> None:
    """Prints one line with the seconds since the start; the trials' output arrives on other threads."""
    with _print_lock:
        sys.stdout.write(f"{time.monotonic() - T0:6.1f}s {line}\n")
        sys.stdout.flush()


@dataclass
class Trial:
    """One ``train.py`` process and the epochs it has reported."""

    name: str
    lr: float
    epochs: int
    proc: subprocess.Popen
    newcomer: bool  # started by a round
    reports: list[dict] = field(default_factory=list)
    fate: str = "running"  # then "finished", "failed (...)" or "killed in round k"
    mark: int = 0  # epochs it had reported when the current round began
    started: float = field(default_factory=time.time)
    killed_at: float | None = None
    replaced_by: str = ""

    @property
    def training(self) -> bool:
        """Running, with epochs left to train."""
        return self.fate == "running" and len(self.reports) < self.epochs

    def loss_after(self, epochs: int) -> float:
        loss = self.reports[epochs - 1]["loss"]
        return loss if math.isfinite(loss) else math.inf  # a diverged trial ranks last

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass  # it has exited already


class Search:
    """The trials of one search and its rounds; :meth:`run` carries it out."""

    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.events: queue.Queue = queue.Queue()  # (trial, epoch report), or (trial, None) when it exits
        self.trials: list[Trial] = []
        self.rounds = 0

    def draw_lr(self) -> float:
        lo, hi = self.args.lr_range
        return float(f"{math.exp(self.rng.uniform(math.log(lo), math.log(hi))):.3g}")

    def start(self, lr: float, newcomer: bool = False, together: list[str] = ()) -> Trial:
        a = self.args
        cmd = [
            sys.executable,
            str(HERE / "train.py"),
            a.data,
            "--lr",
            repr(lr),
            "--epochs",
            str(a.epochs),
            "--batch-size",
            str(a.batch_size),
            "--size",
            str(a.size),
            "--hp-group",
            a.group,
            *together,
        ]
        # A session of its own: Ctrl-C here does not reach it (stop() interrupts it), and a kill
        # of its process group reaches whatever it started.
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True
        )
        trial = Trial(f"t{len(self.trials)}", lr, a.epochs, proc, newcomer)
        self.trials.append(trial)
        threading.Thread(target=self._read, args=(trial,), name=f"read-{trial.name}", daemon=True).start()
        return trial

    def _read(self, trial: Trial) -> None:
        """Forwards a trial's output with its name in front; hands its epoch reports to the main loop."""
        for line in trial.proc.stdout:
            if line.startswith("{"):
                try:
                    report = json.loads(line)
                except ValueError:
                    report = None
                if isinstance(report, dict) and report.get("event") == "epoch":
                    self.events.put((trial, report))
                    continue
            say(f"  [{trial.name}] {line.rstrip()}")
        self.events.put((trial, None))  # its output ended: the process is exiting

    def run(self) -> int:
        a = self.args
        lrs = [float(x) for x in a.lrs.split(",")] if a.lrs else [self.draw_lr() for _ in range(a.trials)]
        say(
            f"{len(lrs)} trials sharing hp_group {a.group!r}, {a.epochs} epochs each; {a.rounds} round(s) of "
            "killing the worst trial (by training loss) and starting a new one"
        )
        together = common.StartTogether()  # the first trials begin their first epoch together
        try:
            for lr in lrs:
                t = self.start(lr, together=together.args())
                say(f"started {t.name}: lr {lr:g}, pid {t.proc.pid}")
            together.go([t.proc for t in self.trials])
            while any(t.fate == "running" for t in self.trials):
                left = a.timeout - (time.monotonic() - T0) if a.timeout else None
                try:
                    trial, report = self.events.get(timeout=None if left is None else max(0.0, left))
                except queue.Empty:
                    say(f"timed out after {a.timeout:g} s; stopping the trials")
                    return 1
                if report is not None:
                    trial.reports.append(report)
                else:
                    self._exited(trial)
                ranked = self._round_due()
                if ranked:
                    self._halve(ranked)
        finally:
            together.close()
            self.stop()
        say(f"all trials done in {time.monotonic() - T0:.1f} s")
        self.summarize()
        return 1 if any(t.fate.startswith("failed") for t in self.trials) else 0

    def _exited(self, trial: Trial) -> None:
        code = trial.proc.wait()
        if trial.fate == "running":
            done = code == 0 and len(trial.reports) == trial.epochs
            trial.fate = "finished" if done else f"failed (exit {code})"
            say(f"{trial.name} (lr {trial.lr:g}) {trial.fate} after {len(trial.reports)} epoch(s)")

    def _round_due(self) -> list[Trial] | None:
        """The trials to rank if a round has just ended, else None."""
        if self.rounds == self.args.rounds:
            return None
        training = [t for t in self.trials if t.training]
        if len(training) < 2:
            say(f"fewer than 2 trials still training: no more rounds after round {self.rounds}")
            self.rounds = self.args.rounds
            return None
        behind = [t for t in training if len(t.reports) == t.mark and (t.reports or not t.newcomer)]
        ranked = [t for t in training if t.reports]
        return ranked if not behind and len(ranked) >= 2 else None

    def _halve(self, ranked: list[Trial]) -> None:
        """Kills the worst of ``ranked`` with SIGKILL and starts a trial with a new learning rate."""
        self.rounds += 1
        k = self.rounds
        m = min(len(t.reports) for t in ranked)
        ranked = sorted(ranked, key=lambda t: t.loss_after(m))
        say(
            f"round {k}: training loss after {m} epoch(s): "
            + ", ".join(f"{t.name} (lr {t.lr:g}) {t.loss_after(m):.3f}" for t in ranked)
        )
        worst = ranked[-1]
        worst.signal(signal.SIGKILL)
        worst.fate, worst.killed_at = f"killed in round {k}", time.time()
        say(
            f"round {k}: killed {worst.name} (lr {worst.lr:g}, pid {worst.proc.pid}) with SIGKILL "
            f"after {len(worst.reports)} epoch(s)"
        )
        new = self.start(self.draw_lr(), newcomer=True)
        worst.replaced_by = new.name
        say(f"round {k}: started {new.name}: lr {new.lr:g}, pid {new.proc.pid}; it joins hp_group {self.args.group!r}")
        for t in self.trials:
            t.mark = len(t.reports)

    def stop(self, grace_s: float = 10.0) -> None:
        """Interrupts the trials still running (they leave the group); kills those that do not stop."""
        alive = [t for t in self.trials if t.proc.poll() is None]
        for t in alive:
            t.signal(signal.SIGINT)
        deadline = time.monotonic() + grace_s
        forced = False
        for t in alive:
            try:
                t.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                t.signal(signal.SIGKILL)
                t.proc.wait()
                forced = True
        if forced:  # a group whose members were all killed stays in shared memory until cleaned
            subprocess.run([sys.executable, "-m", "coordl.cli", "cache", "clean", "--keep-warm"], check=False)

    def summarize(self) -> None:
        say(
            f"{'trial':<6} {'lr':>7}  {'fate':<17} {'epochs':>6}  {'loss':>6}  {'acc':>4}  "
            "batches made by other trials, per epoch"
        )
        for t in self.trials:
            last = t.reports[-1] if t.reports else None
            loss, acc = (f"{last['loss']:.3f}", f"{last['acc']:.0%}") if last else ("-", "-")
            shared = " ".join(f"{r.get('consumed_shared', 0)}/{r['batches']}" for r in t.reports)
            epochs = f"{len(t.reports):>3}/{t.epochs:<2}"
            say(f"{t.name:<6} {t.lr:>7g}  {t.fate:<17} {epochs}  {loss:>6}  {acc:>4}  {shared}")
        self._waits_at_kills()

    def _waits_at_kills(self) -> None:
        """The others' longest wait for a batch in the epoch in which a trial was killed and its
        replacement started, against the median of the other epochs (first epochs, with a start, left out)."""
        at_kill, marked = [], set()
        for dead in (t for t in self.trials if t.killed_at is not None):
            epochs = [
                (t.name, next((r for r in t.reports if r["time"] > dead.killed_at), None))
                for t in self.trials
                if t is not dead and t.started < dead.killed_at
            ]
            epochs = [(name, r) for name, r in epochs if r is not None]
            marked.update(id(r) for _, r in epochs)
            if epochs:
                at_kill.append((dead, max(epochs, key=lambda e: e[1]["wait_max_s"])))
        others = sorted(r["wait_max_s"] for t in self.trials for r in t.reports[1:] if id(r) not in marked)
        median = f"; in the other epochs, {others[len(others) // 2]:.2f} s (median)" if others else ""
        for dead, (who, r) in at_kill:
            say(
                f"epoch in which {dead.name} was killed and {dead.replaced_by} started: the others' longest wait "
                f"for a batch was {r['wait_max_s']:.2f} s ({who}){median}"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_data_args(p, group="lr-halving")
    p.add_argument("--trials", type=int, default=4, help="trials started at first")
    p.add_argument("--rounds", type=int, default=2, help="how many times the worst trial is replaced")
    p.add_argument("--epochs", type=int, default=8, help="epochs of every trial")
    p.add_argument("--lrs", help="learning rates of the first trials, comma-separated (default: drawn)")
    p.add_argument(
        "--lr-range",
        type=float,
        nargs=2,
        default=(0.003, 1.0),
        metavar=("LO", "HI"),
        help="learning rates are drawn log-uniformly from this range",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the learning rates drawn")
    p.add_argument("--timeout", type=float, default=0, help="stop everything after this many seconds (0: never)")
    args = p.parse_args()
    common.resolve_data(p, args)
    if args.trials < 2 or args.rounds < 0 or args.epochs < 1:
        p.error("--trials must be at least 2, --rounds at least 0 and --epochs at least 1")
    # SIGTERM (from a scheduler, or `timeout`) stops the trials as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return Search(args).run()
    except KeyboardInterrupt:
        say("interrupted: the trials were stopped")
        return 130


if __name__ == "__main__":
    sys.exit(main())

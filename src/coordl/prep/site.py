"""Where a loader's batches are prepared: on this machine (:class:`~coordl.Prep`), or also on the
actors of a Ray cluster (:class:`~coordl.RayPrep`).

:func:`site` is the one place that tells the two apart: it returns a :class:`Local` or a
:class:`Remote`, which answer the same questions (what they refuse, the cluster to join, the
actors to start, their figures in ``stats()`` and in the analyzer's report), so that the loader,
its sources and the analyzer never ask which ``prep=`` they hold.
"""

from __future__ import annotations

__all__ = ["Local", "Remote", "site"]


class Local:
    """Prep on this machine: DALI's threads, or the torch backend's workers."""

    def __init__(self, options):
        self.options = options  # the loader's prep= (a coordl.Prep)

    def check(self, backend: str, recipe, cache) -> None:
        """Raises ``ValueError`` when this prep cannot serve a loader of ``backend`` and ``recipe``."""
        from coordl.options import Prep

        if backend == "torch" and self.options != Prep():
            raise ValueError(
                "prep= sets DALI's threads; the torch backend pre-processes in num_workers DataLoader processes "
                "(or on a Ray cluster: prep=coordl.RayPrep(...))"
            )

    def connect(self) -> None:
        """Joins the cluster that prepares batches (none: this machine)."""

    def actors(self, **loader) -> dict | None:
        """The arguments of the actors that prepare batches with this machine (None: none)."""
        return None

    def group_producers(self) -> tuple:
        """What makes an HP group member's share of the group's batches (empty: its own DALI
        pipeline, :class:`~coordl.staging.member.Producer`)."""
        return ()

    def stats_fields(self) -> dict:
        """This prep's own figures in ``stats()``, zero before the first pass."""
        return {}

    def report_fields(self) -> dict:
        """What the analyzer's report says of this prep."""
        return {"remote_output": None, "remote_reads": None}


class Remote(Local):
    """Prep on a Ray cluster's actors, and on this machine while ``RayPrep(local)``."""

    def check(self, backend: str, recipe, cache) -> None:
        o = self.options
        if backend == "torch" and (o.output != "pipeline" or o.threads is not None):
            raise ValueError(
                "RayPrep(output='uint8') and RayPrep(threads) are for DALI's pipelines; on the torch backend the "
                "actors send collate_fn's batches and the local part runs in num_workers DataLoader processes"
            )
        if backend == "dali" and o.output == "uint8" and recipe.normalisation() is None:
            raise ValueError(
                "RayPrep(output='uint8') sends the pixels of 'imagenet-train' or 'imagenet-val' (a float32 "
                "ImageNetTrain or ImageNetVal) before normalisation; this pipeline has no such step: use "
                "output='pipeline'"
            )
        if backend == "dali" and cache.decoded != 0:
            raise ValueError(
                "Cache(decoded=...) and RayPrep: the decoded tier saves this machine's CPUs, remote prep adds "
                "others'; use one of them (Cache(decoded=0) with RayPrep)"
            )

    def connect(self) -> None:
        """Joins the Ray cluster: none there, or one without a node the actors may run on, is said
        when the loader is made, not at its first pass."""
        # lazy: the remote package (Ray's cluster) is a pass above; only prep=RayPrep joins it
        from coordl.remote.cluster import check_nodes, connect

        connect(self.options.address)
        check_nodes(self.options)

    def actors(self, **loader) -> dict | None:
        """The arguments of :meth:`RemotePrep.for_loader <coordl.remote.actors.RemotePrep.for_loader>`."""
        return dict(options=self.options, **loader)

    def group_producers(self) -> tuple:
        """Its Ray actors make group batches too, or alone (``RayPrep(local=False)``)."""
        # lazy: staging and the remote package are passes above; only an HP group's member asks
        from coordl.remote.producer import RemoteProducer
        from coordl.staging.member import Producer

        return (Producer, RemoteProducer) if self.options.local else (RemoteProducer,)

    def stats_fields(self) -> dict:
        # lazy: the remote package is a pass above; only prep=RayPrep reports its counters
        from coordl.remote.raypass import EMPTY_REMOTE_STATS

        return dict(EMPTY_REMOTE_STATS)

    def report_fields(self) -> dict:
        return {"remote_output": self.options.output, "remote_reads": self.options.reads}


def site(prep) -> Local:
    """Where ``prep`` (a loader's ``prep=``, resolved: a Prep or a RayPrep) prepares batches."""
    from coordl.options import RayPrep

    return Remote(prep) if isinstance(prep, RayPrep) else Local(prep)

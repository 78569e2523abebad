"""Who this process is in the job: rank, world size, local rank, node; detected once."""

from __future__ import annotations

from dataclasses import dataclass

from coordl import env

__all__ = ["World", "detect"]


@dataclass(frozen=True)
class World:
    """The place of this process in a (possibly distributed) job.

    Attributes:
        rank: global rank.
        world_size: number of ranks.
        local_rank: rank within this node.
        local_world_size: ranks on this node.
        node_rank: index of this node (torchrun's ``GROUP_RANK``).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of size {self.world_size}")


def detect(rank: int | None = None, world_size: int | None = None) -> World:
    """The world from explicit values, else ``torch.distributed``, else torchrun's environment.

    Args:
        rank: this process's rank, if the caller knows better.
        world_size: number of ranks, if the caller knows better.
    """
    if rank is None or world_size is None:
        dist_rank, dist_world = None, None
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist_rank, dist_world = dist.get_rank(), dist.get_world_size()
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
        if rank is None:
            rank = dist_rank if dist_rank is not None else env.integer("RANK", 0)
        if world_size is None:
            world_size = dist_world if dist_world is not None else env.integer("WORLD_SIZE", 1)
    # Without a launcher saying otherwise, assume one rank per node (each may use all cores).
    local_world = env.integer("LOCAL_WORLD_SIZE", 1)
    return World(
        rank=rank,
        world_size=world_size,
        local_rank=env.integer("LOCAL_RANK", rank % max(local_world, 1)),
        local_world_size=local_world,
        node_rank=env.integer("GROUP_RANK", rank // max(local_world, 1)),
    )

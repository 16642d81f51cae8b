"""Parallel degrees -> validated ParallelDims -> DeviceMesh."""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.config_sections import Parallelism
from titanlite.errors import UserError


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    mesh: DeviceMesh | None = field(default=None, repr=False)  # set by build_mesh

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> "ParallelDims":
        """Resolve data_parallel_shard_degree = -1 and check the degrees multiply to the world."""
        replicate, shard = cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree
        if shard == -1:
            if world_size % replicate:
                raise UserError(
                    f"parallelism.data_parallel_replicate_degree {replicate} does not divide the world size {world_size}; "
                    "choose a divisor of the number of processes"
                )
            shard = world_size // replicate
        if replicate * shard != world_size:
            raise UserError(
                f"parallelism degrees data_parallel_replicate_degree {replicate} x data_parallel_shard_degree {shard} "
                f"= {replicate * shard} do not match the world size {world_size}; set data_parallel_shard_degree = -1 "
                "or launch that many processes"
            )
        return cls(replicate, shard)

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_degree > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        self.mesh = init_device_mesh(
            device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
        )
        return self.mesh

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (replica-major)."""
        replicate, shard = self.mesh.get_coordinate()
        return replicate * self.dp_shard + shard

"""Parallel degrees -> validated ParallelDims -> DeviceMesh (pp x dp_replicate x dp_shard x tp).

tp is innermost, so a TP group is the ranks of one node (its fast links); pp is outermost, so the
rarely-talking pipeline stages are the ones split across nodes.
"""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.config_sections import Parallelism
from titanlite.errors import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    pp: int = 1
    mesh: DeviceMesh | None = field(default=None, repr=False)  # set by build_mesh

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> "ParallelDims":
        """Resolve data_parallel_shard_degree = -1 and check the degrees multiply to the world."""
        replicate, tp, pp = cfg.data_parallel_replicate_degree, cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree
        shard = cfg.data_parallel_shard_degree
        others = replicate * tp * pp
        if shard == -1:
            if world_size % others:
                raise UserError(
                    f"parallelism degrees data_parallel_replicate_degree {replicate} x tensor_parallel_degree {tp} x "
                    f"pipeline_parallel_degree {pp} = {others} do not divide the world size {world_size}; "
                    "choose degrees whose product divides the number of processes"
                )
            shard = world_size // others
        if others * shard != world_size:
            raise UserError(
                f"parallelism degrees pipeline_parallel_degree {pp} x data_parallel_replicate_degree {replicate} x "
                f"data_parallel_shard_degree {shard} x tensor_parallel_degree {tp} = {others * shard} do not match "
                f"the world size {world_size}; set data_parallel_shard_degree = -1 or launch that many processes"
            )
        return cls(replicate, shard, tp, pp)

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def model_parallel_degree(self) -> int:
        """Ranks that together hold one model replica and read the same batch (one TP x PP group)."""
        return self.tp * self.pp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        self.mesh = init_device_mesh(
            device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=MESH_DIMS
        )
        # The global gradient norm reduces over all dims at once; a flattened mesh lets DTensor do
        # that in one collective instead of one per dim.
        self.mesh[MESH_DIMS]._flatten("all")
        return self.mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """(dp_replicate, dp_shard): FSDP shards over dp_shard; with more than one replica it is HSDP."""
        return self.mesh["dp_replicate", "dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (replica-major); TP and PP ranks of one
        data-parallel group share it, so they read the same batches."""
        _, replicate, shard, _ = self.mesh.get_coordinate()
        return replicate * self.dp_shard + shard

    def check_model(self, args) -> None:
        """Refuse degrees the model's shapes cannot be split by, before anything is built."""
        if self.tp_enabled:
            shapes = {"attention heads (n_heads)": args.n_heads,
                      "key/value heads (n_kv_heads)": args.n_kv_heads,
                      "feed-forward hidden size": args.ffn_hidden_dim, "vocabulary size": args.vocab_size,
                      "experts (num_experts)": getattr(args, "num_experts", self.tp)}
            for what, size in shapes.items():
                if size % self.tp:
                    raise UserError(
                        f"parallelism.tensor_parallel_degree {self.tp} does not divide the model's {what} {size}; "
                        "choose a tensor_parallel_degree that divides it"
                    )

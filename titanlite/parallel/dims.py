"""Parallel degrees -> validated ParallelDims -> DeviceMesh (pp x dp_replicate x dp_shard x tp).

tp is innermost, so a TP group is the ranks of one node (its fast links); pp is outermost, so the
rarely-talking pipeline stages are the ones split across nodes.

Expert parallelism (ep > 1) splits dp_shard into (efsdp, ep): the mesh is
pp x dp_replicate x efsdp x ep x tp, with dp_shard the flattened (efsdp, ep). Every dense weight is
sharded over dp_shard as without EP; the routed experts are split over the ep ranks (consecutive
dp_shard ranks, so an all-to-all group stays as close as TP allows) and FSDP-sharded over efsdp
(and replicated over dp_replicate). With TP as well (ep x tp), the experts are split over the
flattened (ep, tp) mesh, ep * tp whole-expert blocks, one per rank (see titanlite/parallel/ep.py).
"""

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlite.config_sections import Parallelism
from titanlite.errors import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
EP_MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "tp")  # dp_shard = the flattened (efsdp, ep)


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel degree: a divisor of dp_shard
    mesh: DeviceMesh | None = field(default=None, repr=False)  # set by build_mesh
    # Under EP, dp_shard is a flattened mesh; slicing it out of the root again is deprecated (torch 2.11).
    shard_mesh: DeviceMesh | None = field(default=None, repr=False)
    # Under EP, the ranks whose whole-expert blocks together hold all the experts: ep, or the flattened
    # (ep, tp) under EP x TP (rank (e, t) holds block e * tp + t); set by build_mesh.
    expert_mesh: DeviceMesh | None = field(default=None, repr=False)

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
        ep = cfg.expert_parallel_degree
        if shard % ep:
            raise UserError(
                f"parallelism.expert_parallel_degree {ep} does not divide data_parallel_shard_degree {shard}; "
                "choose an expert_parallel_degree that divides the data-parallel shard ranks"
            )
        return cls(replicate, shard, tp, pp, ep)

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

    @property
    def layout(self) -> str:
        """The mesh in words, for the start-up log and the planner."""
        experts = f" (experts over ep {self.ep} of them)" if self.ep_enabled else ""
        return f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard}{experts} x tp {self.tp}, pp {self.pp}"

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        if self.ep_enabled:
            self.mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp),
                                         mesh_dim_names=EP_MESH_DIMS)
            self.shard_mesh = self.mesh["efsdp", "ep"]._flatten("dp_shard")
            self.expert_mesh = self.mesh["ep", "tp"]._flatten("ep_tp") if self.tp_enabled else self.mesh["ep"]
        else:
            self.mesh = init_device_mesh(
                device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=MESH_DIMS
            )
            self.shard_mesh = self.mesh["dp_shard"]
        # The global gradient norm reduces over all dims at once; a flattened mesh lets DTensor do
        # that in one collective instead of one per dim.
        self.mesh[self.mesh.mesh_dim_names]._flatten("all")
        return self.mesh

    @property
    def ep_mesh(self) -> DeviceMesh:
        """The ranks one MoE block's experts are split over, which exchange tokens with all-to-all."""
        return self.mesh["ep"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """(dp_replicate, efsdp): the ranks holding the same experts, which FSDP shards them over
        (efsdp alone where there is one replica)."""
        return self.mesh["dp_replicate", "efsdp"] if self.dp_replicate > 1 else self.mesh["efsdp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """(dp_replicate, dp_shard): FSDP shards over dp_shard; with more than one replica it is HSDP
        (dp_shard alone where there is one replica)."""
        return self.mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.shard_mesh

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (replica-major); TP and PP ranks of one
        data-parallel group share it, so they read the same batches."""
        return self.mesh["dp_replicate"].get_local_rank() * self.dp_shard + self.shard_mesh.get_local_rank()

    def check_model(self, args) -> None:
        """Refuse degrees the model's shapes cannot be split by, before anything is built."""
        experts = getattr(args, "num_experts", 0)
        if self.ep_enabled and (not experts or experts % (self.ep * self.tp)):
            split = f"{self.ep} x tensor_parallel_degree {self.tp}" if self.tp_enabled else f"{self.ep}"
            raise UserError(
                f"parallelism.expert_parallel_degree {split} cannot split the model's {experts} experts (num_experts) "
                "evenly; choose degrees whose product divides the experts, or expert_parallel_degree 1 for a model without experts"
            )
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

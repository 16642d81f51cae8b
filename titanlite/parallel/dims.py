"""Parallel degrees -> validated ParallelDims -> DeviceMesh (pp x dp_replicate x dp_shard x cp x tp).

tp is innermost, so a TP group is the ranks of one node (its fast links); pp is outermost, so the
rarely-talking pipeline stages are the ones split across nodes. cp sits next to tp: its ranks
exchange every attention's keys and values, the next heaviest traffic.

Context parallelism (cp > 1) splits each sequence over the cp ranks (parallel/cp.py); they read the
same batches as one data-parallel rank, and FSDP shards the weights over the flattened (dp_shard, cp),
so their gradients are averaged with the data-parallel ones.

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

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_MESH_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "tp")  # dp_shard = the flattened (efsdp, ep)


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel degree: a divisor of dp_shard
    cp: int = 1  # context parallel degree: ranks that split each sequence
    mesh: DeviceMesh | None = field(default=None, repr=False)  # set by build_mesh
    # Under EP, dp_shard is a flattened mesh; slicing it out of the root again is deprecated (torch 2.11).
    shard_mesh: DeviceMesh | None = field(default=None, repr=False)
    # The ranks FSDP shards the weights over: dp_shard, or the flattened (dp_shard, cp) under CP.
    fsdp_shard_mesh: DeviceMesh | None = field(default=None, repr=False)
    # Under EP, the ranks whose whole-expert blocks together hold all the experts: ep, or the flattened
    # (ep, tp) under EP x TP (rank (e, t) holds block e * tp + t); set by build_mesh.
    expert_mesh: DeviceMesh | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> "ParallelDims":
        """Resolve data_parallel_shard_degree = -1 and check the degrees multiply to the world."""
        replicate, tp, pp = cfg.data_parallel_replicate_degree, cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree
        shard, cp = cfg.data_parallel_shard_degree, cfg.context_parallel_degree
        others = replicate * cp * tp * pp
        if shard == -1:
            if world_size % others:
                raise UserError(
                    f"parallelism degrees data_parallel_replicate_degree {replicate} x context_parallel_degree {cp} x "
                    f"tensor_parallel_degree {tp} x pipeline_parallel_degree {pp} = {others} do not divide the world "
                    "size "
                    f"{world_size}; choose degrees whose product divides the number of processes"
                )
            shard = world_size // others
        if others * shard != world_size:
            raise UserError(
                f"parallelism degrees pipeline_parallel_degree {pp} x data_parallel_replicate_degree {replicate} x "
                f"data_parallel_shard_degree {shard} x context_parallel_degree {cp} x tensor_parallel_degree {tp} = "
                f"{others * shard} do not match the world size {world_size}; set data_parallel_shard_degree = -1 or "
                "launch that many processes"
            )
        ep = cfg.expert_parallel_degree
        if shard % ep:
            raise UserError(
                f"parallelism.expert_parallel_degree {ep} does not divide data_parallel_shard_degree {shard}; "
                "choose an expert_parallel_degree that divides the data-parallel shard ranks"
            )
        if ep > 1 and cp > 1:
            raise UserError(
                "parallelism.expert_parallel_degree and context_parallel_degree cannot both be above 1 yet; "
                "use context parallelism with expert_parallel_degree 1 (experts split over tensor_parallel_degree)"
            )
        return cls(replicate, shard, tp, pp, ep, cp)

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over the data-parallel ranks and the context-parallel ones."""
        return self.gradient_average_degree > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def gradient_average_degree(self) -> int:
        """The ranks FSDP averages every gradient over: each data-parallel rank, and each cp rank of it
        (a cp rank's loss is the mean over its share of the sequence)."""
        return self.dp_degree * self.cp

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
    def batch_sharing_degree(self) -> int:
        """Ranks that read the same batch: one TP x PP group, times the cp ranks splitting its sequences."""
        return self.model_parallel_degree * self.cp

    @property
    def layout(self) -> str:
        """The mesh in words, for the start-up log and the planner."""
        experts = f" (experts over ep {self.ep} of them)" if self.ep_enabled else ""
        context = f" x cp {self.cp}" if self.cp_enabled else ""
        shards = f"dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard}{experts}{context}"
        return f"{shards} x tp {self.tp}, pp {self.pp}"

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        if self.ep_enabled:
            self.mesh = init_device_mesh(
                device_type,
                (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp),
                mesh_dim_names=EP_MESH_DIMS,
            )
            self.shard_mesh = self.fsdp_shard_mesh = self.mesh["efsdp", "ep"]._flatten("dp_shard")
            self.expert_mesh = self.mesh["ep", "tp"]._flatten("ep_tp") if self.tp_enabled else self.mesh["ep"]
        else:
            self.mesh = init_device_mesh(
                device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp), mesh_dim_names=MESH_DIMS
            )
            self.shard_mesh = self.fsdp_shard_mesh = self.mesh["dp_shard"]
            if self.cp_enabled:
                self.fsdp_shard_mesh = self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
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
        """(dp_replicate, dp_shard): FSDP shards over dp_shard (or the flattened (dp_shard, cp)); with more
        than one replica it is HSDP (the shard dim alone where there is one replica)."""
        if self.dp_replicate == 1:
            return self.fsdp_shard_mesh
        return self.mesh["dp_replicate", "dp_shard_cp" if self.cp_enabled else "dp_shard"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self.mesh["cp"]

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
                "evenly; choose degrees whose product divides the experts, or expert_parallel_degree 1 for a model "
                "without experts"
            )
        if self.tp_enabled:
            shapes = {
                "attention heads (n_heads)": args.n_heads,
                "key/value heads (n_kv_heads)": args.n_kv_heads,
                "feed-forward hidden size": args.ffn_hidden_dim,
                "vocabulary size": args.vocab_size,
                "experts (num_experts)": getattr(args, "num_experts", self.tp),
            }
            for what, size in shapes.items():
                if size % self.tp:
                    raise UserError(
                        f"parallelism.tensor_parallel_degree {self.tp} does not divide the model's {what} {size}; "
                        "choose a tensor_parallel_degree that divides it"
                    )

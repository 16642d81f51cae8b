"""The GPUs and networks the planner knows, with where each figure comes from, and the few
efficiencies its speed model uses (plan/speed.py), with the rows each was set from.

Memory is what torch.cuda.get_device_properties().total_memory reports (GiB), a little under
the data sheet's GB. Peaks are dense (no sparsity) tensor-core TFLOP/s; the bf16 ones are
metrics.py's PEAK_BF16_TFLOPS (the table MFU uses), looked up by the same device-name key.
HBM bandwidth in TB/s; links per GPU, per direction, in GB/s.

Sources: NVIDIA data sheets - A100 (nvidia.com/en-us/data-center/a100: 312 bf16, 1.56 TB/s (40GB),
2.04 TB/s (80GB SXM), NVLink3 600 GB/s bidirectional), H100 SXM/PCIe (nvidia.com/en-us/data-center/h100:
989/756 bf16, 1979/1513 fp8, 3.35/2.0 TB/s, NVLink4 900 GB/s bidirectional, PCIe Gen5 128 GB/s
bidirectional; H100 NVL 835 bf16), H200 (nvidia.com/en-us/data-center/h200: 141 GB, 4.8 TB/s, same compute
as H100 SXM), HGX B200 (180 GB, 2.25/4.5 PFLOP/s dense bf16/fp8 per GPU, 8 TB/s, NVLink5 1.8 TB/s
bidirectional), GB200 NVL72 (186 GB per GPU, 2.5/5 PFLOP/s dense, 8 TB/s). Fabrics: InfiniBand NDR
ConnectX-7, 400 Gb/s per GPU; AWS p5 EFA, 3200 Gb/s per node of 8 GPUs (aws.amazon.com/ec2/instance-types/p5).

"H100 96GB 500W" is the GPU of Meta's Grand Teton hosts, where the reference framework's (torchtitan's)
published H100 rows ran (github.com/pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md at
commit b5bcd76): an SXM H100 with 96 GB of HBM2e at 2.4 TB/s, run at a 500 W power limit, whose
"actual peak TFLOPs number is between SXM and NVL" (that file's footnote 2). Its speed against
titanlite's H100 is GRAND_TETON_CLOCK, fitted.
"""

from dataclasses import dataclass

from titanlite.errors import UserError
from titanlite.metrics import PEAK_BF16_TFLOPS


@dataclass(frozen=True)
class Gpu:
    name: str
    metrics_key: str  # the device-name key of metrics.PEAK_BF16_TFLOPS
    memory_gib: float
    fp8_tflops: float  # 0 = no float8 tensor cores
    hbm_tbps: float
    link_gbps: float  # NVLink (or PCIe) per direction
    arch: str  # which measured efficiencies apply (MATMUL, ATTENTION)
    clock: float = 1.0  # share of the data sheet's peak that its power limit sustains

    @property
    def bf16_tflops(self) -> float:
        """The data sheet's peak: the MFU denominator, as metrics.py uses it."""
        return dict(PEAK_BF16_TFLOPS)[self.metrics_key]


# The Grand Teton H100's speed against the H100 the measured constants come from: fitted on its tuning rows.
# It covers the 500 W power cap, which torchtitan's footnote bounds to 835/989 = 0.84 .. 1 of the peak, and
# the software of its runs (torch and torchtitan of 2024-25, FlashAttention 2 through SDPA; titanlite's
# H100 run used cuDNN's attention on torch 2.11).
GRAND_TETON_CLOCK = 0.66

GPUS = {
    gpu.name: gpu
    for gpu in (
        Gpu("A100 40GB", "A100", 39.4, 0.0, 1.56, 300.0, "ampere"),
        Gpu("A100 80GB", "A100", 79.2, 0.0, 2.04, 300.0, "ampere"),
        Gpu("H100 SXM", "H100", 79.1, 1979.0, 3.35, 450.0, "hopper"),
        Gpu("H100 PCIe", "H100 PCIe", 79.1, 1513.0, 2.0, 64.0, "hopper"),
        Gpu("H100 96GB 500W", "H100", 94.5, 1979.0, 2.4, 450.0, "hopper", clock=GRAND_TETON_CLOCK),
        Gpu("H200", "H200", 139.8, 1979.0, 4.8, 450.0, "hopper"),
        Gpu("B200", "B200", 178.4, 4500.0, 8.0, 900.0, "blackwell"),
        Gpu("GB200", "GB200", 184.0, 5000.0, 8.0, 900.0, "blackwell"),
    )
}

FABRIC_GBPS = {"infiniband_ndr": 50.0, "efa_p5": 50.0}  # per GPU, per direction

# The speed model's constants. "Measured" ones come from the torch.profiler breakdown of titanlite's
# compiled bf16 step on one H100 80GB HBM3 (Llama 3.2 1B, seq 8192, batch 2; torch 2.11, CUDA 13;
# November 2026; docs/benchmarks.md "One H100"): 313 ms = GEMMs 158 ms, flash attention 84 ms,
# elementwise kernels 40 ms, fused AdamW 19 ms. "Fitted" ones were fitted on the tuning rows of
# plan/published_table.py only (scripts/fit_planner.py); docs/benchmarks.md holds every row's error.

# Matmul FLOPs (6 per parameter per token) at this share of the peak: measured, 6 x 1.236e9 x 16,384 FLOP
# in 158 ms (that H100's measured bf16 matmul limit was 804 TFLOP/s, 0.81). The ampere value is fitted; no
# Blackwell run has been measured or published to us, so it takes Hopper's.
MATMUL = {"hopper": 0.78, "blackwell": 0.78, "ampere": 0.767}
# Attention FLOPs as metrics.py counts them (the full score matrix, causal or not): measured,
# 12 x 16 x 2048 x 8192 x 16,384 FLOP in 84 ms.
ATTENTION = {"hopper": 0.64, "blackwell": 0.64, "ampere": 0.64 * 0.767 / 0.78}
# Share of the HBM bandwidth that memory-bound kernels reach: measured on the fused AdamW step
# (it reads parameters, gradients and moments and writes parameters and moments: 2 x 19.8 GB in 19 ms).
BANDWIDTH = 0.62
# Bytes the compiled elementwise kernels (norms, SwiGLU, RoPE, residual adds, the loss's softmax) move
# per token, per unit of width: a block of P parameters at model dim d counts P / d units, the loss
# counts the vocabulary; measured, 40 ms at 1B's 16 x 29,696 + 128,256 units x 16,384 tokens.
ELEMENTWISE_BYTES = 8.4
EAGER_ELEMENTWISE = 3.24  # without compile the same kernels run unfused and move this many times more: fitted
# float8: the blocks' Linear matmuls at MATMUL of the float8 peak, plus the casts and scales, memory-bound, at
# these bytes per element of the tensors cast (plan/speed.py cast_widths: each linear's input and output
# gradient, an input its sibling linears share counted once): fitted.
FLOAT8_CAST_BYTES = {"tensorwise": 11.1, "rowwise": 19.9}
COLLECTIVE_EFFICIENCY = 0.75  # FSDP's and PP's: NCCL ring bus bandwidth reached, as a fraction of the link's
# TP's collectives wait, each, for the slowest of the tp ranks to reach it (seconds per collective): fitted
# on rows of 12-16 sequences per TP group (every published TP row has that many); below, an extrapolation.
# Async TP hides this share of their bytes' time behind the matmuls: fitted.
TP_SYNC_S = 0.00147
ASYNC_TP_HIDDEN = 0.381


def check_dtype(gpu: Gpu, dtype: str) -> None:
    if dtype == "float8" and gpu.fp8_tflops == 0:
        raise UserError(
            f"plan.gpu {gpu.name} has no float8 tensor cores; set float8.enable false or pick a GPU with float8 (H100, "
            "H200, B200, GB200)"
        )

"""The GPUs and networks the planner knows, with where each figure comes from.

Memory is what torch.cuda.get_device_properties().total_memory reports (GiB), a little under
the data sheet's GB. Peaks are dense (no sparsity) tensor-core TFLOP/s; the bf16 ones are
metrics.py's PEAK_BF16_TFLOPS (the table MFU uses), looked up by the same device-name key.
Links are per GPU, per direction, in GB/s.

Sources: NVIDIA data sheets - A100 (nvidia.com/en-us/data-center/a100: 312 bf16, NVLink3 600 GB/s
bidirectional), H100 SXM/PCIe (nvidia.com/en-us/data-center/h100: 989/756 bf16, 1979/1513 fp8,
NVLink4 900 GB/s bidirectional, PCIe Gen5 128 GB/s bidirectional), H200 (nvidia.com/en-us/data-center/h200:
141 GB, same compute as H100 SXM), HGX B200 (180 GB, 2.25/4.5 PFLOP/s dense bf16/fp8 per GPU, NVLink5
1.8 TB/s bidirectional), GB200 NVL72 (186 GB per GPU, 2.5/5 PFLOP/s dense). Fabrics: InfiniBand NDR
ConnectX-7, 400 Gb/s per GPU; AWS p5 EFA, 3200 Gb/s per node of 8 GPUs (aws.amazon.com/ec2/instance-types/p5).

EFFICIENCY is the one table of achievable fractions of peak (per GPU and dtype) for a compiled
Llama-style training step: MFU that torchtitan and Megatron-LM publish for bf16 on A100/H100
(about 40-57%), and float8 speed-ups of 1.2-1.5x over bf16 although its peak is 2x (docs/benchmarks.md
sets the predictions beside the published numbers; the constants are not tuned per row).
"""

from dataclasses import dataclass

from titanlite.errors import UserError
from titanlite.metrics import PEAK_BF16_TFLOPS

EAGER_SLOWDOWN = 0.85  # fraction of the compiled speed without compile (unfused norms, RoPE, SwiGLU)
COLLECTIVE_EFFICIENCY = 0.75  # NCCL ring bus bandwidth reached, as a fraction of the link's


@dataclass(frozen=True)
class Gpu:
    name: str
    metrics_key: str  # the device-name key of metrics.PEAK_BF16_TFLOPS
    memory_gib: float
    fp8_tflops: float  # 0 = no float8 tensor cores
    link_gbps: float  # NVLink (or PCIe) per direction

    @property
    def bf16_tflops(self) -> float:
        return dict(PEAK_BF16_TFLOPS)[self.metrics_key]


GPUS = {gpu.name: gpu for gpu in (
    Gpu("A100 40GB", "A100", 39.4, 0.0, 300.0),
    Gpu("A100 80GB", "A100", 79.2, 0.0, 300.0),
    Gpu("H100 SXM", "H100", 79.1, 1979.0, 450.0),
    Gpu("H100 PCIe", "H100 PCIe", 79.1, 1513.0, 64.0),
    Gpu("H200", "H200", 139.8, 1979.0, 450.0),
    Gpu("B200", "B200", 178.4, 4500.0, 900.0),
    Gpu("GB200", "GB200", 184.0, 5000.0, 900.0),
)}

FABRIC_GBPS = {"infiniband_ndr": 50.0, "efa_p5": 50.0}  # per GPU, per direction

# Achievable fraction of the dtype's peak (compiled step); float8 counts the Linear layers it runs.
EFFICIENCY = {
    ("A100 40GB", "bfloat16"): 0.55, ("A100 80GB", "bfloat16"): 0.55,
    ("H100 SXM", "bfloat16"): 0.45, ("H100 PCIe", "bfloat16"): 0.45, ("H200", "bfloat16"): 0.47,
    ("B200", "bfloat16"): 0.40, ("GB200", "bfloat16"): 0.40,
    ("H100 SXM", "float8"): 0.30, ("H100 PCIe", "float8"): 0.30, ("H200", "float8"): 0.32,
    ("B200", "float8"): 0.27, ("GB200", "float8"): 0.27,
    # float32 matmuls run as TF32 on tensor cores at half the bf16 rate.
    **{(name, "float32"): 0.5 * 0.45 for name in ("A100 40GB", "A100 80GB", "H100 SXM", "H100 PCIe", "H200", "B200", "GB200")},
}


def efficiency(gpu: Gpu, dtype: str) -> float:
    if (gpu.name, dtype) not in EFFICIENCY:
        raise UserError(f"plan.gpu {gpu.name} has no {dtype} tensor cores; set float8.enable false or pick a GPU with float8 (H100, H200, B200, GB200)")
    return EFFICIENCY[(gpu.name, dtype)]

"""The dtypes config values name (training.*_dtype, mixed_precision_*, checkpoint.export_dtype), for every layer."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

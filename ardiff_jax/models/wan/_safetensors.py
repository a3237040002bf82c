"""The lazy, validating ``.safetensors`` reader the Wan loaders use, re-exported.

It is model-independent and lives in :mod:`ardiff_jax._checkpoint_files` (shared by every
model's loaders: Wan's DiT, VAE and umT5, Matrix-Game's CLIP); its names stay importable here.
"""

from __future__ import annotations

from ardiff_jax._checkpoint_files import (
    MAX_EXPECTED_TENSORS,
    SAFETENSORS_DTYPES,
    SafetensorsError,
    SafetensorsFile,
    TensorInfo,
    header_budget,
)

__all__ = ["SafetensorsError", "SafetensorsFile", "TensorInfo", "SAFETENSORS_DTYPES", "header_budget",
           "MAX_EXPECTED_TENSORS"]

"""AWQ int4 weights: calibration text, quantising a base model once into a cached checkpoint, loading it or a
published AWQ checkpoint as it is.

Rooms: calibration.py the calibration text, gptq_cpu.py gptqmodel's import and CPU patches, quantizing.py
the quantising, layout.py what a folder's files declare (a published checkpoint's AWQ layout, its tensors),
checkpoint.py the cache folder, its key and its checks, load.py the loading, native.py servelab's own int4 layers
(loading a checkpoint without gptqmodel, ATen's int4 matmul). Importing this package does not import gptqmodel;
quantising does, and loading for one of gptqmodel's kernels. Does not know decoding or evaluation.
"""

from servelab.engine.awq.calibration import CALIBRATION_TASKS, calibration_texts, calibration_windows
from servelab.engine.awq.checkpoint import (
    RECORD_FILE,
    CheckpointSlot,
    QuantizeRecord,
    QuantMethod,
    awq_checkpoint_dir,
    validate_checkpoint,
)
from servelab.engine.awq.gptq_cpu import batched_best_clip, import_gptqmodel
from servelab.engine.awq.layout import AWQCheckpointError, AWQLayout, published_layout
from servelab.engine.awq.load import KERNEL_BACKENDS, kernel_name, load_awq_model, serving_dtype
from servelab.engine.awq.quantizing import quantize, quantize_rtn

__all__ = [
    "CALIBRATION_TASKS", "KERNEL_BACKENDS", "RECORD_FILE", "AWQCheckpointError", "AWQLayout", "CheckpointSlot",
    "QuantMethod", "QuantizeRecord", "awq_checkpoint_dir", "batched_best_clip",
    "calibration_texts", "calibration_windows", "import_gptqmodel", "kernel_name", "load_awq_model",
    "published_layout", "quantize", "quantize_rtn", "serving_dtype", "validate_checkpoint",
]

"""The engine: the model, its kernels, the KV cache tensors, sampling and decoding, and the runners that execute a
scheduler's plans (see engine.py and runner.py).

NOTE: importing this package quiets two libraries' import-time warnings a user cannot act on, before any engine
module imports torch or transformers: torchao's `Failed to load ... _C_mxfp8 ...` (kernels for other GPUs) and
torch's `_pytree` deprecation of Enum constants (torchao's registrations). Their loggers keep ERROR and above.
gptqmodel's banner and kernel lines are quieted where it is imported (awq/gptq_cpu.py).
"""

import logging

for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

"""Lets Accelerate apply FSDP on a machine without a GPU, for the tests only (tests/dist_scripts/accelerate_train.py).

Accelerate 1.15 applies FSDP only on an accelerator. In `AcceleratorState.__init__` (accelerate/state.py, the branch
`elif self.distributed_type in [DistributedType.MULTI_GPU, DistributedType.MULTI_MLU, ..., MULTI_NEURON]:`) the
FSDP plugin becomes the state's and the type becomes `FSDP`; `MULTI_CPU`, what a CPU run with `use_cpu` /
`ACCELERATE_USE_CPU=1` gets from `PartialState._prepare_backend`, is not in that list. So a CPU run of
examples/accelerate/fsdp2.yaml stays plain DDP, with no warning (and without `use_cpu` its type is `NO`: each
process trains alone on its share of the batches).

`lift()` wraps `AcceleratorState.__init__`: when the state is made for the first time, with a `MULTI_CPU` type and
FSDP asked for (the launcher's `ACCELERATE_USE_FSDP=true`, or a plugin passed), it does what that branch does for a
GPU (the state's `fsdp_plugin`, its mixed precision, the type `FSDP`, in the shared state too). Nothing else of
Accelerate changes; on a GPU, or for any other type, the wrapper does nothing. FSDP2 itself (`fully_shard`) runs on CPU
with gloo as on a GPU with NCCL.
"""

import functools
import os

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType


def lift() -> None:
    original = AcceleratorState.__init__
    if getattr(original, "lifted_for_cpu_fsdp", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        first = AcceleratorState._shared_state == {}
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        wants_fsdp = fsdp_plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        if first and wants_fsdp and self.distributed_type == DistributedType.MULTI_CPU:
            if self._mixed_precision != "no" and fsdp_plugin is not None:
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            self.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    __init__.lifted_for_cpu_fsdp = True
    AcceleratorState.__init__ = __init__

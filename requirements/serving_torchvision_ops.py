"""Makes the package index's torchvision importable beside a CPU build of torch, in the serving test environment.

The index's torchvision wheels are CUDA builds: their C++ extension needs libtorch_cuda.so, fails to load beside
torch 2.13.0+cpu, and torchvision then dies at import, because it registers fake kernels for two of the extension's
operators (`torchvision::nms`, `torchvision::qnms`) whether the extension loaded or not. vLLM's Qwen3.5 model imports
torchvision (through Transformers' Qwen2-VL image processor), so without this vLLM cannot serve a Qwen3.5 folder.

`make test-serving` installs this file into `.venv-serving` with a `.pth` line that imports it at start-up. It adds
an import hook that, when torchvision (having tried to load its extension) imports its registrations, defines the
schemas of those two operators if the extension did not: the import then succeeds with torchvision's Python code
(the image transforms) and without its C++ operators, which text models never call (calling one raises an error).
With a CPU build of torchvision (the PyTorch CPU wheel index) the operators exist and the hook defines nothing.

Start-up imports only `sys` and `importlib.abc`; torch is imported when torchvision is.
"""

import importlib.abc
import sys

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
DEFINED: list[str] = []  # what this hook defined (empty with a working torchvision extension)
_libraries = []  # a torch.library.Library removes its definitions when garbage-collected: keep it


def define_missing_operators() -> None:
    """Defines the schemas in `SCHEMAS` of the operators that torchvision's extension has not defined."""
    import torch

    missing = [name for name in SCHEMAS if not hasattr(torch.ops.torchvision, name)]
    if missing:
        library = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            library.define(SCHEMAS[name])
        _libraries.append(library)
        DEFINED.extend(missing)


class BeforeTorchvisionRegistrations(importlib.abc.MetaPathFinder):
    """Calls `define_missing_operators` once, when `torchvision._meta_registrations` is about to be imported
    (torchvision's `__init__` imports it right after trying to load the extension)."""

    def find_spec(self, name, path, target=None):
        if name == "torchvision._meta_registrations":
            sys.meta_path.remove(self)
            define_missing_operators()
        return None


if not any(type(finder).__name__ == BeforeTorchvisionRegistrations.__name__ for finder in sys.meta_path):
    sys.meta_path.insert(0, BeforeTorchvisionRegistrations())

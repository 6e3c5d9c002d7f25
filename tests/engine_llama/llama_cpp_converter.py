"""llama.cpp's own converter, `convert_hf_to_gguf.py` (from the llama-cpp-python source release, unpacked into
.venv-llama/llama.cpp by `make test-llama`), run as its command line runs it, with one step given: the name of the
tokenizer's pre-tokenizer. The converter recognises the tokenizers of published models by a hash of how they split
a fixed text; a tiny tokenizer trained here is none of them (the converter stops with "BPE pre-tokenizer was not
recognized"), so its name, GPT-2's byte-level split (`tests/helpers.tiny_tokenizer`), is given instead.

    python llama_cpp_converter.py CONVERTER.py SRC --outfile OUT.gguf --outtype f32 --no-mtp
"""

import runpy
import sys
from pathlib import Path

converter = Path(sys.argv[1]).resolve()
sys.path.insert(0, str(converter.parent))
sys.path.insert(1, str(converter.parent / "gguf-py"))  # as the converter itself does, first
from conversion.base import TextModel  # noqa: E402  (the converter's package, found through the path above)

TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [str(converter), *sys.argv[2:]]
runpy.run_path(str(converter), run_name="__main__")

"""The glue that plugs gated_qwen into other libraries, apart from the model (`model/`) and the kernel (`kernel/`),
as Liger-Kernel keeps its `transformers/` glue apart from its `ops/`:

    gated_triton.py   Transformers' attention backend `attn_implementation="gated_triton"`: registers the fused
                      kernel's attention function (kernel/attention.py) and its mask
    kernel_hub.py     the Hub kernel: kernel/ as a repository Hugging Face's `kernels` loads (make kernel-repo), which
                      a saved folder's own code uses where the package is not installed
    vllm_plugin.py    vLLM's plugin entry point: registers vllm_model.py's model for gated_qwen folders
    vllm_model.py     gated_qwen in vLLM's own layers, with the gate
    peft_defaults.py  PEFT's default LoRA targets for the gated model types
    model_card.py     the Hugging Face Hub: the model card (`gated-qwen card`) and `push_to_hub` with it
"""

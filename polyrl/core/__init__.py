"""Hardware-free core: interfaces, algorithms, trainer, config and reference kernels.

Nothing under this package imports a vendor module (torch.cuda, torch_npu, triton, vllm, flash_attn);
tests/test_layering.py walks the AST to keep it so.
"""

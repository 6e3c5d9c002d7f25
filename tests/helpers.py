"""Helpers shared by the test modules (importable because pytest puts tests/ on sys.path)."""

import torch


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random values in every parameter, norms included (a norm weight of ones would hide a missing norm)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=generator))
    return model

"""What mtp reaches for inside torch and transformers that they do not publish, in one place: private attributes
and operators, and the patches of inductor's code generation that make the compiled pass fast on a CPU. Nothing
else in mtp touches a name that begins with an underscore in torch, inductor or transformers (a test reads the
sources)."""

import torch


def version(tensor: torch.Tensor) -> int:
    """How many times `tensor` was changed in place (torch's counter, for caches of what is computed from a weight);
    0 for an inference tensor, which keeps no counter: made under `torch.inference_mode()`, it can change only
    there, and a cache of it is not renewed."""
    return 0 if tensor.is_inference() else tensor._version

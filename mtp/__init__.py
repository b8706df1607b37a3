"""mtp: train multi-token-prediction heads on a frozen Hugging Face causal LM, and decode with them.

The names below are looked up when first used, so that importing one part (say `mtp.training.loss`) builds only
what that part imports."""

from importlib import import_module

_HOMES = {
    "load": "mtp.loading",
    "Decoder": "mtp.decoding.decoder",
    "GenerationResult": "mtp.decoding.decoder",
    "Lookup": "mtp.decoding.lookup",
    "Sampling": "mtp.decoding.sampling",
    "Drafter": "mtp.drafters.contract",
    "Eagle": "mtp.drafters.eagle",
    "HydraHeads": "mtp.drafters.heads",
    "MedusaHeads": "mtp.drafters.heads",
    "fast_linears": "mtp.linears",
    "usual_linears": "mtp.linears",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'mtp' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)

"""The kinds of drafter, by the `head_type` their folder's config names."""

from mtp.eagle import Eagle
from mtp.heads import HydraHeads, MedusaHeads

DRAFTERS = {"medusa": MedusaHeads, "hydra": HydraHeads, "eagle": Eagle}

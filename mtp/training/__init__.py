"""Training: the Lightning module that trains a drafter on a frozen base, its losses, the data (chat rows, the base
model's own answers by self-distillation)."""

"""Drafters: the contract every kind of drafter keeps (`contract.Drafter`, its config and its folder), and the kinds:
Medusa and Hydra heads (`heads`), the feature-level EAGLE-3-style drafter (`eagle`)."""

"""Drafters: the contract every kind of drafter keeps (`contract.Drafter`, its config and its folder), and the kinds:
Medusa and Hydra heads (`heads`), the feature-level EAGLE-3-style drafter (`eagle`). Importing any part of this
package imports every kind, and each joins `Drafter.kinds` as it is defined."""

import mtp.drafters.eagle  # noqa: F401
import mtp.drafters.heads  # noqa: F401

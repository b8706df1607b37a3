"""Decoding: the verifier and its step (propose, verify, accept, commit) over a batch of rows, the trees it verifies,
the target model, the cache, the acceptance rules, prompt lookup, and the pacing that fits each step to the machine."""

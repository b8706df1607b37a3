"""Command-line tools over a trained drafter: benchmark (`bench`), size its trees for a machine (`sizing`), export
it to other engines (`export`), measure an adapter's drift (`drift`)."""

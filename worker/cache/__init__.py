"""The cache state and the store traffic: what a sequence holds, restores, copies from a sibling and publishes."""

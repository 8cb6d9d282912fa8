"""netweave.placement (work in progress)."""

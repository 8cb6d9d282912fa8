"""netweave.flowsched (work in progress)."""

"""netweave.pipesched (work in progress)."""

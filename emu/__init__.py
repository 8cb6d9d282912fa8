"""netweave.emu (work in progress)."""

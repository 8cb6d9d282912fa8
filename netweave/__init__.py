"""The netweave command line, demo and benchmark runner (the top of the stack)."""

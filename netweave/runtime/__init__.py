"""The runtime inside a user's training script: reads a ``netweave launch`` bundle's job plan and carries it out.

It imports the plan format (:mod:`netweave.runtime.plan`) and torch only: no planners, no emulator.
"""

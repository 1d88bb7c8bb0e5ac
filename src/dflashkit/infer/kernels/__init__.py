"""The hand-written Triton kernels of the graphs engine's ``--layers triton`` and their tuning, in one place:
the target's decoder layer in six kernels (``decoder``, its source in ``decoder_source``, its tiles and splits
tuned in ``decoder.Tiles``), the drafter's step through them (``draft``), and a tree round's small steps
(``tree``). The CPU runs them only in Triton's interpreter (the tests)."""

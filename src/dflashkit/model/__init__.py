"""The DFlash drafter: config (config.py), model and draft cache (drafter.py), checkpoints in the
z-lab and speculators layouts (checkpoint.py), and the `init` / `convert` commands (commands.py).

Nothing is imported here so that the command line starts fast; import from the submodules.
"""

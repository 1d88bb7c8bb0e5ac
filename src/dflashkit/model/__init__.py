"""The DFlash drafter: config (config.py), model and draft cache (drafter.py), checkpoints in the
z-lab and speculators layouts (checkpoint.py), and the acceptance length a block earns (acceptance.py).
The `init` and `convert` commands are in dflashkit.commands.model.

Nothing is imported here so that the command line starts fast; import from the submodules.
"""

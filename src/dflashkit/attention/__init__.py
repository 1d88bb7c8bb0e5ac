"""DFlash attention: the training mask (flex mask_mod + dense reference) and the backends behind one function."""

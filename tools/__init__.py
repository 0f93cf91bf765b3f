"""Scripts run on a GPU machine or by hand (not part of the installed package)."""
